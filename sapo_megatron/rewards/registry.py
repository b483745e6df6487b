"""Reward functions by name, :func:`check_registered` (before training), and :class:`SafeReward`, which
keeps a crashing reward from stopping training – up to a per-step error budget."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sapo_megatron.rewards.answers import exact_match, extract_last_number, numeric_match
from sapo_megatron.rewards.code_exec import code_exec
from sapo_megatron.rewards.code_tasks import check_settings
from sapo_megatron.rewards.dapo import dapo_math
from sapo_megatron.rewards.logic import knights_knaves, mixed_tasks
from sapo_megatron.rewards.math_verify_reward import INSTALL_HINT, math_verify_available, math_verify_reward
from sapo_megatron.rewards.outputs import to_output
from sapo_megatron.rewards.types import RewardError

logger = logging.getLogger(__name__)


class RewardFn(Protocol):
    """Scores one decoded response against its label; returns a float or a dict with ``score``."""

    def __call__(self, response: str, label: str) -> float | dict[str, Any]: ...


_REGISTRY: dict[str, RewardFn] = {}
_MISSING_DEPENDENCY: dict[str, Callable[[], str | None]] = {}
"""Per reward, a check that returns what is missing to run it (None when it can run)."""


def register_reward(
    name: str, *, missing_dependency: Callable[[], str | None] | None = None
) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make a reward function available to configs under ``name``.

    ``missing_dependency`` returns a message (what to install) when the reward cannot run here, else None;
    :func:`check_reward_available` calls it before training.
    """

    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"a reward named {name!r} is already registered")
        _REGISTRY[name] = fn
        if missing_dependency is not None:
            _MISSING_DEPENDENCY[name] = missing_dependency
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(_REGISTRY)}") from None


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)


def check_registered(name: str, *, field: str = "algorithm.reward", kwargs=None) -> None:
    """Raise :class:`~sapo_megatron.errors.ConfigError` (about ``field``) when ``name`` is not a registered
    reward, a package it needs is missing, or it cannot take ``kwargs``, so that a run never scores every sample
    0. Any spec (import paths, reward servers): :func:`~sapo_megatron.rewards.runner.check_reward_available`."""
    from sapo_megatron.errors import ConfigError

    if name not in _REGISTRY:
        raise ConfigError(
            f"{field}={name!r} is not a registered reward (or an import path 'file.py:fn' / 'pkg.mod:fn'); "
            "registered: " + ", ".join(available_rewards())
        )
    missing = _MISSING_DEPENDENCY.get(name, lambda: None)()
    if missing:
        raise ConfigError(f"{field}={name!r} cannot run here: {missing}")
    if kwargs:
        from sapo_megatron.rewards.loading import RewardSpecError, check_signature

        try:
            check_signature(_REGISTRY[name], kwargs)
            _CHECK_KWARGS.get(name, lambda _: None)(kwargs)
        except (RewardSpecError, ValueError) as exc:
            raise ConfigError(f"{field}={name!r}: {exc}", hint="fix algorithm.reward_kwargs") from None


register_reward("exact_match")(exact_match)
register_reward("numeric_match")(numeric_match)
register_reward("math_verify", missing_dependency=lambda: None if math_verify_available() else INSTALL_HINT)(
    math_verify_reward
)
register_reward("dapo_math")(dapo_math)
register_reward("code_exec")(code_exec)
_CHECK_KWARGS: dict[str, Callable[[Any], None]] = {"code_exec": check_settings}
"""Per reward, a check of its ``reward_kwargs``' values (ranges), run before training."""
register_reward("knights_knaves")(knights_knaves)
register_reward("mixed_tasks")(mixed_tasks)


NUMERIC_REWARDS = ("numeric_match",)
"""Registered rewards that compare numbers: a label without a number always scores 0 with them."""


def check_labels(spec: object, rows: Sequence[Any], where: str) -> None:
    """A numeric reward over labels without a number: every label → :class:`ConfigError`; some → one warning
    naming how many and the first (those prompts can only score 0)."""
    if spec not in NUMERIC_REWARDS:
        return
    bad = [i for i, row in enumerate(rows) if extract_last_number(str(row.ground_truth)) is None]
    if not bad:
        return
    first = f"row {bad[0]} ({str(rows[bad[0]].ground_truth)!r:.60})"
    if len(bad) == len(rows):
        from sapo_megatron.errors import ConfigError

        raise ConfigError(
            f"algorithm.reward={spec!r} compares numbers, but no label of {where} holds one (first: {first})",
            hint="use exact_match, math_verify or your own reward for non-numeric answers",
        )
    logger.warning(
        "%s: %d of %d labels hold no number, so %s scores those prompts 0 (first: %s)",
        where,
        len(bad),
        len(rows),
        spec,
        first,
    )


class SafeReward:
    """Wraps a reward: an exception (or a non-finite value) yields 0.0 and counts as an error.

    ``errors`` / ``calls`` count the whole run; the step counters (since the last :meth:`take_step_metrics`)
    feed ``reward/error_frac`` and :meth:`check_error_budget`, which stops the run when a step's share of
    errors is too high. The first exception of the run is logged with its traceback; later ones only count.
    """

    def __init__(self, fn: RewardFn, name: str | None = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.errors = 0
        self.calls = 0
        self._step_errors = 0
        self._step_calls = 0
        self._step_first_error: str | None = None
        self._lock = threading.Lock()

    def __call__(self, response: str, ground_truth: str) -> float:
        with self._lock:
            self.calls += 1
            self._step_calls += 1
        try:
            output = to_output(self.fn(response, ground_truth))
            if output.error is not None:
                raise ValueError(f"reward {self.name}: {output.error}")
            return output.score
        except Exception as exc:
            self._count_error(exc)
            return 0.0

    def _count_error(self, exc: Exception) -> None:
        with self._lock:
            self.errors += 1
            self._step_errors += 1
            first_of_run = self.errors == 1
            if self._step_first_error is None:
                self._step_first_error = f"{type(exc).__name__}: {exc}"
        if first_of_run:
            logger.exception("reward %s raised; scoring 0.0 (later errors are only counted)", self.name)

    def metrics(self) -> dict[str, float]:
        """Counts of the whole run."""
        with self._lock:
            return {"reward/errors": float(self.errors), "reward/calls": float(self.calls)}

    def take_step_metrics(self) -> dict[str, float]:
        """``reward/error_frac`` (errors / calls, 0 without calls) and ``reward/errors`` since the previous
        call, then start counting the next step."""
        with self._lock:
            calls, errors = self._step_calls, self._step_errors
            self._step_calls = self._step_errors = 0
            self._step_first_error = None
        return {"reward/error_frac": errors / calls if calls else 0.0, "reward/errors": float(errors)}

    def check_error_budget(self, max_frac: float) -> None:
        """Raise :class:`RewardError` when more than ``max_frac`` of this step's calls raised (a step without
        calls passes). Call it before :meth:`take_step_metrics`, which resets the step."""
        with self._lock:
            calls, errors, first = self._step_calls, self._step_errors, self._step_first_error
        if not calls or errors / calls <= max_frac:
            return
        raise RewardError(
            f"reward {self.name!r} raised on {errors} of {calls} samples this step ({errors / calls:.0%}), "
            f"more than algorithm.max_reward_error_frac={max_frac}; first error: {first}",
            hint="fix the reward (or install what it needs); those samples would all score 0",
        )


def safe_reward(fn: RewardFn, name: str | None = None) -> SafeReward:
    return SafeReward(fn, name)
