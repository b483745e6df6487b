"""Where each RL step's batch comes from: generated now (synchronous, on-policy), or – with
``trainer.rollout_mode: one_step_off`` – generated in the background while the trainer trains on the previous batch
(one step off-policy, the schedule of slime's ``train_async.py``, NeMo-RL's async GRPO with
``max_trajectory_age_steps: 1`` and AReaL with ``max_head_offpolicyness: 1``).

The trainer calls :class:`RolloutPipeline` at two points of every step, on every rank:

- :meth:`~RolloutPipeline.next_batch` at the start: the batch for this step, then (async) the generation of the
  next batch starts in a background thread of the main rank, on the weights the engine holds now – the weights
  this step starts from;
- :meth:`~RolloutPipeline.push_weights` at the end: (async) wait for the batch in flight, hand it to every rank,
  then push the new weights. The engine never receives weights while it generates, and an evaluation or a
  checkpoint after the step never overlaps a generation.

Timeline under async (``G(n)`` generates batch ``n``, ``T(n)`` trains on it, ``P(v)`` pushes weights ``v``)::

    main thread:   G(0) | T(0) ......... wait P(1) | T(1) ......... wait P(2) | T(2) ...
    background:         | G(1) on W(0) ...        | G(2) on W(1) ...         |

so batch ``n`` (for ``n >= 1``) is sampled by ``W(n-1)`` and trained from ``W(n)``: ``rollout/staleness`` is 1,
the engine's log-probs are one version behind the old-log-prob pass (which uses the trainer's weights at the
start of the step), and TIS / IcePop / SAPO see that mismatch. The first step (and a step after a resume without
a batch in flight) generates now: staleness 0.

Resume stays exact: a checkpoint written after a step holds the batch in flight (complete by then, see above) in
``rollout_in_flight.pt``, and a resumed run trains on it instead of regenerating it. Regenerating would need the
weights that sampled it, which the checkpoint no longer holds (it holds the next version); the batch is small
next to them (token ids, log-probs, and the routes when ``rollout.routed_experts`` asks for them).

Errors of the background generation (engine, reward budget, data) are kept and re-raised in the loop at the
next wait, with their type, message and hint; the other ranks raise :class:`~sapo_megatron.runtime.ranks.MainRankFailed`
with the same message (as for any work of the main rank). Only the main rank generates; the reward runs where
generation runs (in the background thread: math-verify then runs without its ``signal.alarm`` timeouts).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from sapo_megatron.algo.decoupled import staleness_metrics
from sapo_megatron.data.prompts import PromptIterator
from sapo_megatron.errors import UserError
from sapo_megatron.loop.in_flight import IN_FLIGHT_FILE
from sapo_megatron.loop.session import Session
from sapo_megatron.model.batching import TrainSequence
from sapo_megatron.runtime.interrupts import WaitInterrupted
from sapo_megatron.runtime.ranks import on_main_rank

logger = logging.getLogger(__name__)

_FORMAT = 1


class RolloutResumeError(UserError):
    """A checkpoint's batch in flight that does not belong to the step the run resumes at."""


@dataclass
class Rollout:
    """One generated batch for RL step ``step``: the training sequences, its rollout metrics, where the prompt
    data stands after it (refills included), and ``policy_version``, the RL step whose starting weights the
    engine held when it generated the batch (its weight version)."""

    step: int
    sequences: list[TrainSequence]
    metrics: dict[str, float]
    prompt_state: dict[str, Any]
    policy_version: int


Generate = Callable[[int], tuple[list[TrainSequence], dict[str, float], dict[str, Any]]]
"""``generate(step)``: the main rank's rollout for RL step ``step`` (0-based): the sequences, their metrics and the
prompt iterator's state afterwards. It draws its prompts from the pipeline's iterator."""


class _Background:
    """One call of ``work`` in a daemon thread; :meth:`result` waits and returns its value or re-raises its
    exception (the traceback points into the thread)."""

    def __init__(self, work: Callable[[], Rollout]) -> None:
        self._work = work
        self._value: Rollout | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-in-flight", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._work()
        except BaseException as exc:  # kept for the loop, which re-raises it: nothing is lost in the thread
            self._error = exc

    def result(self) -> Rollout:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    def abandon(self, timeout_s: float) -> BaseException | None:
        """Wait up to ``timeout_s`` without raising; returns the thread's error, if it ended with one."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the rollout in flight is still running after %.0f s; leaving it", timeout_s)
        return self._error


class RolloutPipeline:
    """The RL loop's source of batches; a context manager (leaving it waits briefly for a generation still in
    flight, so that the engine is not closed under it). Every rank makes one and calls it at the same points.

    ``overlap`` (``trainer.rollout_mode: one_step_off``): generate the next batch while the trainer trains. ``start_step``:
    the first RL step of this process (a resumed run's checkpoint step); ``total_steps``: no generation starts
    for a step past the last. ``generate`` runs on the main rank only.
    """

    def __init__(
        self,
        session: Session,
        prompts: PromptIterator,
        generate: Generate,
        *,
        start_step: int,
        total_steps: int,
        overlap: bool,
    ) -> None:
        self.session = session
        self.prompts = prompts
        self._generate = generate
        self.total_steps = total_steps
        self.overlap = overlap
        self.engine_version = start_step  # the run pushed the weights of start_step before the first step
        self._ready: Rollout | None = None  # on every rank: the batch for the next step, complete
        self._background: _Background | None = None  # main rank: the generation in flight
        self._in_flight = False  # every rank: a generation was started for the next step
        self._waited = 0.0
        self._step_started = 0.0
        if session.start.resume and session.start.checkpoint is not None:
            self._ready = self._load(session.start.checkpoint.path, start_step)
        if session.checkpointer is not None:
            session.checkpointer.attachments[IN_FLIGHT_FILE] = self._payload

    # -- the two calls of a step ------------------------------------------------------------------------

    def next_batch(self, step: int) -> tuple[list[TrainSequence], dict[str, float]]:
        """Every rank: the batch to train at RL step ``step`` and its metrics (``rollout/staleness`` among them);
        under ``overlap``, the next step's generation starts in the background before this returns."""
        self._step_started = time.perf_counter()
        self._waited = 0.0
        rollout, self._ready = self._ready, None
        if rollout is None:  # sync, the first step, or a resume without a batch in flight: generate now
            rollout = self._timed(lambda: on_main_rank(self.session.info, lambda: self._rollout(step)))
            self.prompts.load_state_dict(rollout.prompt_state)
        self._in_flight = self.overlap and step + 1 < self.total_steps
        if self._in_flight and self.session.info.is_main:
            self._background = _Background(lambda: self._rollout(step + 1))
        metrics = dict(rollout.metrics)
        metrics["rollout/staleness"] = float(step - rollout.policy_version)
        metrics.update(sequence_staleness(rollout.sequences, step, buckets=1))
        return rollout.sequences, metrics

    def push_weights(self, module: torch.nn.Module) -> dict[str, float]:
        """Every rank, after the step's updates (collective): wait for the batch in flight and share it, then
        push the weights to the engine. Returns the sync's metrics and the step's rollout wait (main rank)."""
        if self._in_flight:
            self._ready = self._timed(lambda: on_main_rank(self.session.info, self._take_background))
            self.prompts.load_state_dict(self._ready.prompt_state)
            self._in_flight = False
        try:
            metrics = self.session.sync.push(module)
        except (
            WaitInterrupted
        ):  # a signal during the sync: end_of_step checkpoints and stops (resume re-syncs)
            return {"weight_sync/interrupted": 1.0}
        self.engine_version += 1
        if self.session.info.is_main:
            metrics["time/rollout_wait_s"] = self._waited
            metrics["time/step_s"] = time.perf_counter() - self._step_started
        return metrics

    # -- internals --------------------------------------------------------------------------------------

    def _rollout(self, step: int) -> Rollout:
        version = self.engine_version  # read when the generation starts: the weights it samples from
        sequences, metrics, prompt_state = self._generate(step)
        return Rollout(step, at_version(sequences, version), metrics, prompt_state, version)

    def _take_background(self) -> Rollout:
        background, self._background = self._background, None
        assert background is not None, "no generation in flight on the main rank"
        return background.result()

    def _timed(self, wait: Callable[[], Rollout]) -> Rollout:
        start = time.perf_counter()
        try:
            return wait()
        finally:
            self._waited += time.perf_counter() - start

    def _payload(self) -> bytes | None:
        """The batch in flight for a checkpoint (main rank; ``None``: nothing in flight)."""
        if self._ready is None or not self.session.info.is_main:
            return None
        return rollout_to_bytes(self._ready)

    def _load(self, checkpoint: Path, step: int) -> Rollout | None:
        path = checkpoint / IN_FLIGHT_FILE
        return on_main_rank(
            self.session.info, lambda: rollout_from_file(path, step) if path.exists() else None
        )

    # -- context manager --------------------------------------------------------------------------------

    def __enter__(self) -> RolloutPipeline:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.session.checkpointer is not None:
            self.session.checkpointer.attachments.pop(IN_FLIGHT_FILE, None)
        background, self._background = self._background, None
        if background is None:
            return
        # Only reached when the loop failed mid-step: its error propagates; the thread's must not vanish either.
        error = background.abandon(timeout_s=min(self.session.cfg.rollout.timeout_s, 60.0))
        if error is not None:
            logger.error("the rollout in flight failed too: %s: %s", type(error).__name__, error)


def with_versions(sequences: list[TrainSequence], version: int) -> list[TrainSequence]:
    """``sequences`` with every response token's policy version set: those the engine reported
    (``Sample.token_versions``, partial rollouts) kept, the others ``version`` (the weights the generation started
    with)."""
    return [
        s if s.versions is not None else dataclasses.replace(s, versions=[version] * len(s.response_ids))
        for s in sequences
    ]


def at_version(sequences: list[TrainSequence], version: int) -> list[TrainSequence]:
    """``sequences`` with every response token of policy version ``version``: sync and one_step_off never update
    the weights during a generation, so the versions an engine reports in its own count are replaced."""
    return [dataclasses.replace(s, versions=[version] * len(s.response_ids)) for s in sequences]


def sequence_staleness(
    sequences: list[TrainSequence], trainer_version: int, *, buckets: int
) -> dict[str, float]:
    """``staleness/*`` (:func:`~sapo_megatron.algo.decoupled.staleness_metrics`) of the trained tokens of
    ``sequences`` at ``trainer_version``."""
    per_sample = [
        [
            trainer_version - version
            for version, trained in zip(s.versions or (), s.response_mask or [1] * len(s.response_ids))
            if trained
        ]
        for s in sequences
    ]
    return {name: float(value) for name, value in staleness_metrics(per_sample, buckets).items()}


def rollout_to_bytes(rollout: Rollout) -> bytes:
    """``rollout`` as tensors, strings and numbers only (``torch.load`` with ``weights_only=True`` reads it back:
    no pickled code). Every field of :class:`TrainSequence` is kept: lists as int64 / float64 tensors (every
    log-prob and advantage exact), arrays (routes) in their own dtype."""
    state = {
        "format": _FORMAT,
        "step": rollout.step,
        "policy_version": rollout.policy_version,
        "metrics": {k: float(v) for k, v in rollout.metrics.items()},
        "prompt_state": rollout.prompt_state,
        "sequences": [
            {f.name: _pack(getattr(s, f.name)) for f in dataclasses.fields(TrainSequence)}
            for s in rollout.sequences
        ],
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def rollout_from_file(path: Path, step: int) -> Rollout:
    """Read what :func:`rollout_to_bytes` wrote; refuses a batch saved for another step than ``step``."""
    state = torch.load(path, weights_only=True)
    if state.get("format") != _FORMAT or state.get("step") != step:
        raise RolloutResumeError(
            f"{path} holds the batch in flight for RL step {state.get('step')} (format {state.get('format')}), "
            f"but the checkpoint resumes at step {step}",
            hint="the checkpoint directory was edited or mixed with another run's files; resume from an intact "
            "checkpoint",
        )
    sequences = [
        TrainSequence(**{name: _unpack(value) for name, value in s.items()}) for s in state["sequences"]
    ]
    return Rollout(
        step, sequences, dict(state["metrics"]), dict(state["prompt_state"]), int(state["policy_version"])
    )


def _pack(value: Any) -> Any:
    """One field of a sequence in a form ``weights_only`` loading accepts (see :func:`_unpack`)."""
    if isinstance(value, np.ndarray):
        return {"array": torch.from_numpy(value.copy())}
    if isinstance(value, (list, tuple)):  # Python ints -> int64, floats -> float64 (exact)
        return {"list": torch.from_numpy(np.asarray(value))}
    if isinstance(value, Mapping):  # token_values: name -> per-token values
        return {"mapping": {str(key): _pack(item) for key, item in value.items()}}
    return value  # None, str, int, float


def _unpack(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    if "mapping" in value:
        return {key: _unpack(item) for key, item in value["mapping"].items()}
    return value["array"].numpy() if "array" in value else value["list"].tolist()
