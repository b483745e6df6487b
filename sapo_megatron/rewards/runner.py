"""The reward runner the trainer and the evaluation use: one ``score(inputs)`` call per batch, inline, in a pool
of worker processes, or on a remote server; it counts errors against ``algorithm.max_reward_error_frac``.

``algorithm.reward_workers``: ``0`` scores inline in the calling process (on the main thread under the same
timeout and the run's signals, :func:`limits.inline_call`), ``N >= 1`` in N worker processes with ``algorithm.reward_timeout_s`` per call, ``auto`` (the default) inline
for the cheap string rewards (``exact_match``, ``numeric_match``, ``dapo_math``) and a pool otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from sapo_megatron.rewards.calling import BoundReward
from sapo_megatron.rewards.limits import inline_call
from sapo_megatron.rewards.loading import RewardSpecError, absolute_spec, check_signature, is_import_path
from sapo_megatron.rewards.pool import WorkerPool
from sapo_megatron.rewards.registry import check_registered
from sapo_megatron.rewards.remote import RemoteReward, RemoteSettings
from sapo_megatron.rewards.types import RewardError, RewardInput, RewardOutput

logger = logging.getLogger(__name__)


class RewardServerSection(Protocol):
    """A reward server's config section (``algorithm.reward: {url: ...}``, a pydantic model)."""

    def model_dump(self) -> dict[str, Any]: ...


RewardSpec = str | Mapping[str, Any] | RewardServerSection | list[Any]
"""A registered name, an import path (``file.py:fn`` / ``pkg.mod:fn``), ``{url: ..., api_key_env: ...}``, or a list
of those (each a spec or ``{reward: SPEC, weight: W, name: N, kwargs: {...}}``): the weighted sum of their scores
(TRL's ``reward_funcs`` with ``reward_weights``), see :class:`RewardMix`."""

INLINE_BY_DEFAULT = frozenset({"exact_match", "numeric_match", "dapo_math", "knights_knaves"})


class _Backend(Protocol):
    def run(self, units: list[list[RewardInput]]) -> list[list[RewardOutput]]: ...

    def close(self) -> None: ...


class _Inline:
    """Scores in this process, each call under the timeout and the run's signals (:func:`limits.inline_call`)."""

    def __init__(self, bound: BoundReward, timeout_s: float | None = None) -> None:
        self.bound, self.timeout_s = bound, timeout_s

    def run(self, units: list[list[RewardInput]]) -> list[list[RewardOutput]]:
        return self._limited(self.bound.run, units)

    def run_each(self, items: list[RewardInput]) -> list[RewardOutput]:
        return self._limited(self.bound.run_one, items)

    def _limited(self, call: Any, work: list[Any]) -> list[Any]:
        from sapo_megatron.runtime.interrupts import stop_requested

        out = []
        with inline_call(self.timeout_s, stop_requested) as clock:
            for item in work:  # clock.running() inlined: this loop is the demo's hot path
                clock.restart()
                clock.active = True
                try:
                    out.append(call(item))
                finally:
                    clock.active = False
        return out

    def close(self) -> None:
        pass


def _remote_settings(spec: Any) -> RemoteSettings:
    """A reward server's settings from a non-string spec (a mapping or a config section)."""
    values = spec.model_dump() if hasattr(spec, "model_dump") else dict(spec)
    return RemoteSettings(**values)


def default_workers(spec: RewardSpec) -> int:
    """What ``reward_workers: auto`` means for ``spec``."""
    if not isinstance(spec, str) or spec in INLINE_BY_DEFAULT:
        return 0
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def check_reward_spec(
    spec: RewardSpec, *, field: str = "algorithm.reward", kwargs: Mapping | None = None
) -> None:
    """Raise :class:`~sapo_megatron.config.ConfigError` naming ``field`` when the reward cannot be used: unknown
    name, missing dependency, not importable, not callable, a signature it cannot be called with."""
    from sapo_megatron.errors import ConfigError

    if isinstance(spec, list):
        for index, (entry, _, _, entry_kwargs) in enumerate(mix_entries(spec)):
            check_reward_spec(entry, field=f"{field}[{index}]", kwargs=entry_kwargs)
        return
    if not isinstance(spec, str):
        try:
            remote = _remote_settings(spec)
        except TypeError as exc:
            raise ConfigError(f"{field}: a reward server is {{url: ..., api_key_env: ...}}: {exc}") from None
        if not remote.url.startswith(("http://", "https://")):
            raise ConfigError(f"{field}.url={remote.url!r} must start with http:// or https://")
        return
    if not is_import_path(spec):
        check_registered(spec, field=field)
    try:
        bound = BoundReward.from_spec(absolute_spec(spec))
        check_signature(bound.fn, kwargs or {})
    except RewardSpecError as exc:
        raise ConfigError(f"{field}={spec!r}: {exc}") from None


def check_reward_available(spec: RewardSpec, *, field: str = "algorithm.reward", kwargs=None) -> None:
    """Any reward spec, before training: a registered name (:func:`~.registry.check_registered`: known, its
    packages installed, ``kwargs`` accepted), an import path or a reward server (:func:`check_reward_spec`)."""
    if isinstance(spec, list):
        for index, (entry, _, _, entry_kwargs) in enumerate(mix_entries(spec)):
            check_reward_available(entry, field=f"{field}[{index}]", kwargs=entry_kwargs)
    elif isinstance(spec, str) and ":" not in spec:
        check_registered(spec, field=field, kwargs=kwargs)
    else:
        check_reward_spec(spec, field=field, kwargs=kwargs)


def build_reward_runner(
    spec: RewardSpec,
    *,
    workers: int | str = "auto",
    timeout_s: float = 30.0,
    name: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    field: str = "algorithm.reward",
    after_thinking: bool = False,
) -> RewardRunner:
    """The runner for ``spec`` (checked with :func:`check_reward_spec` first, errors naming ``field``);
    ``workers``: 0 inline, N a pool, ``"auto"`` (module docstring); ``after_thinking``: the reward scores the
    text after a response's thinking block (``algorithm.reward_after_thinking``)."""
    check_reward_spec(spec, kwargs=kwargs, field=field)
    if isinstance(spec, list):
        parts = [
            (
                part,
                weight,
                build_reward_runner(entry, workers=workers, timeout_s=timeout_s, kwargs=entry_kwargs),
            )
            for entry, weight, part, entry_kwargs in mix_entries(spec)
        ]
        title = name or " + ".join(f"{w:g}×{n}" for n, w, _ in parts)
        return RewardMix(parts, title, after_thinking=after_thinking)
    if not isinstance(spec, str):
        remote = _remote_settings(spec)
        return RewardRunner(
            RemoteReward(remote), name or remote.url, group=False, after_thinking=after_thinking
        )
    spec = absolute_spec(spec)
    count = default_workers(spec) if workers == "auto" else int(workers)
    bound = BoundReward.from_spec(spec, kwargs)
    backend: _Backend
    if count:
        backend = WorkerPool(spec, kwargs or {}, workers=count, timeout_s=timeout_s)
    else:
        backend = _Inline(bound, timeout_s)
    return RewardRunner(backend, name or spec, group=bound.group, after_thinking=after_thinking)


@dataclasses.dataclass
class _StepCounts:
    """One thread's scoring since its last :meth:`RewardRunner.take_step_metrics`."""

    calls: int = 0
    errors: int = 0
    first_error: str | None = None
    seconds: float = 0.0
    sums: dict[str, float] = dataclasses.field(default_factory=dict)  # RewardMix: per function
    scored: int = 0  # RewardMix: inputs scored


class RewardRunner:
    """Scores batches (:meth:`score`) and counts calls / errors for the run and for the step.

    The step counters are per thread: a rollout (one ``collect`` call: its scoring, :meth:`check_error_budget`,
    :meth:`take_step_metrics`) runs in one thread, and the fully-async producer runs several rollouts at once, each
    in its own thread, whose step metrics and error budget stay its own."""

    def __init__(self, backend: _Backend, name: str, *, group: bool, after_thinking: bool = False) -> None:
        self.backend, self.name, self.group = backend, name, group
        self.after_thinking = after_thinking
        self.errors = self.calls = 0
        self._local = threading.local()
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()  # the async rollout thread and the evaluation may both score

    def score(self, inputs: list[RewardInput]) -> list[RewardOutput]:
        """One output per input, in order; never raises for a failing reward (errors are counted instead)."""
        if not inputs:
            return []
        start = time.perf_counter()
        if isinstance(self.backend, _Inline) and not self.group:  # the demo's path: no per-sample wrapping
            outputs = self.backend.run_each(inputs)
        else:
            with self._backend_lock:
                outputs = [out for unit in self.backend.run(self._units(inputs)) for out in unit]
        self._count(outputs, time.perf_counter() - start)
        return outputs

    def _step(self) -> _StepCounts:
        """This thread's step counters."""
        counts = getattr(self._local, "counts", None)
        if counts is None:
            counts = self._local.counts = _StepCounts()
        return counts

    def _units(self, inputs: list[RewardInput]) -> list[list[RewardInput]]:
        if not self.group:
            return [[item] for item in inputs]
        units: list[list[RewardInput]] = []
        for item in inputs:
            if units and units[-1][0].group_id == item.group_id:
                units[-1].append(item)
            else:
                units.append([item])
        return units

    def _count(self, outputs: list[RewardOutput], seconds: float) -> None:
        errors = [out.error for out in outputs if out.error is not None] if outputs else []
        step = self._step()
        step.calls += len(outputs)
        step.errors += len(errors)
        step.seconds += seconds
        if errors and step.first_error is None:
            step.first_error = errors[0]
        with self._lock:
            first_of_run = self.errors == 0 and bool(errors)
            self.calls += len(outputs)
            self.errors += len(errors)
        if first_of_run:
            logger.error(
                "reward %s failed: %s; scoring 0.0 (later errors are only counted)", self.name, errors[0]
            )

    def metrics(self) -> dict[str, float]:
        """Counts of the whole run."""
        with self._lock:
            out = {"reward/errors": float(self.errors), "reward/calls": float(self.calls)}
        if isinstance(self.backend, WorkerPool):
            out["reward/worker_restarts"] = float(self.backend.restarts)
            out["reward/timeouts"] = float(self.backend.timeouts)
        return out

    def take_step_metrics(self) -> dict[str, float]:
        """``reward/error_frac``, ``reward/errors`` and ``time/reward_s`` of this thread since its previous call."""
        step, self._local.counts = self._step(), _StepCounts()
        calls, errors, seconds = step.calls, step.errors, step.seconds
        return {
            "reward/error_frac": errors / calls if calls else 0.0,
            "reward/errors": float(errors),
            "time/reward_s": seconds,
        }

    def check_error_budget(self, max_frac: float) -> None:
        """Raise :class:`RewardError` when more than ``max_frac`` of this step's samples failed (see
        :class:`~sapo_megatron.rewards.registry.SafeReward`, whose semantics this keeps)."""
        step = self._step()
        calls, errors, first = step.calls, step.errors, step.first_error
        if not calls or errors / calls <= max_frac:
            return
        raise RewardError(
            f"reward {self.name!r} failed on {errors} of {calls} samples this step ({errors / calls:.0%}), "
            f"more than algorithm.max_reward_error_frac={max_frac}; first error: {first}",
            hint=_budget_hint(first),
        )

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _budget_hint(first_error: str | None) -> str:
    """What to do, by what the first error says (a timeout, a reward server, or the reward itself)."""
    text = first_error or ""
    if "timed out" in text:
        what = "make the reward faster or raise algorithm.reward_timeout_s"
    elif text.startswith("reward server"):
        what = "check the reward server: its URL, algorithm.reward.api_key_env and the server's own log"
    else:
        what = "fix the reward (or install what it needs)"
    return f"{what}; those samples would all score 0"


def mix_entries(spec: list[Any]) -> list[tuple[Any, float, str, dict[str, Any]]]:
    """``(spec, weight, name, kwargs)`` of each entry of a reward list; the name (for the per-function metrics)
    defaults to the function's (``file.py:fn`` → ``fn``), made unique with its index."""
    out: list[tuple[Any, float, str, dict[str, Any]]] = []
    for index, item in enumerate(spec):
        values = item.model_dump() if hasattr(item, "model_dump") else item
        if isinstance(values, Mapping) and "reward" in values:
            entry, weight = values["reward"], float(values.get("weight", 1.0))
            name, kwargs = values.get("name"), dict(values.get("kwargs") or {})
        else:
            entry, weight, name, kwargs = values, 1.0, None, {}
        if name is None:
            name = entry.rpartition(":")[2] if isinstance(entry, str) else "remote"
        if any(name == other for _, _, other, _ in out):
            name = f"{name}_{index}"
        out.append((entry, weight, name, kwargs))
    return out


class RewardMix(RewardRunner):
    """Several rewards scored on the same batch, each in its own runner (inline, pool or server), combined as
    ``sum_i weight_i * score_i`` (TRL's ``(rewards_per_func * reward_weights).nansum(dim=1)``; an entry that
    errs adds 0, its error still counted). Each sample's fields get every function's score
    under its name; :meth:`take_step_metrics` adds ``reward/<name>/mean`` per function (TRL's
    ``rewards/<name>/mean``)."""

    def __init__(
        self, parts: list[tuple[str, float, RewardRunner]], name: str, *, after_thinking: bool
    ) -> None:
        super().__init__(_MixBackend(parts), name, group=False, after_thinking=after_thinking)
        self.parts = parts

    def score(self, inputs: list[RewardInput]) -> list[RewardOutput]:
        if not inputs:
            return []
        start = time.perf_counter()
        per_part = [runner.score(inputs) for _, _, runner in self.parts]
        outputs = [self._combine([scored[i] for scored in per_part]) for i in range(len(inputs))]
        self._count(outputs, time.perf_counter() - start)
        step = self._step()
        for (part_name, _, _), scored in zip(self.parts, per_part):
            step.sums[part_name] = step.sums.get(part_name, 0.0) + sum(out.score for out in scored)
        step.scored += len(inputs)
        return outputs

    def _combine(self, outs: list[RewardOutput]) -> RewardOutput:
        fields: dict[str, Any] = {}
        for out in outs:
            fields.update(out.fields)
        fields.update({part_name: out.score for (part_name, _, _), out in zip(self.parts, outs)})
        error = next((out.error for out in outs if out.error is not None), None)
        total = sum(weight * out.score for (_, weight, _), out in zip(self.parts, outs))
        return RewardOutput(total, fields, error)

    def take_step_metrics(self) -> dict[str, float]:
        step = self._step()
        out = super().take_step_metrics()
        for _, _, runner in self.parts:
            runner.take_step_metrics()  # their own step counters restart with the mix's
        count = max(step.scored, 1)
        out.update({f"reward/{name}/mean": step.sums.get(name, 0.0) / count for name, _, _ in self.parts})
        return out


class _MixBackend:
    """The parts' runners, closed together (scoring goes through :meth:`RewardMix.score`)."""

    def __init__(self, parts: list[tuple[str, float, RewardRunner]]) -> None:
        self.parts = parts

    def run(self, units: list[list[RewardInput]]) -> list[list[RewardOutput]]:
        raise NotImplementedError("RewardMix.score calls its parts")

    def close(self) -> None:
        for _, _, runner in self.parts:
            runner.close()
