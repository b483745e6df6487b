"""Fully asynchronous rollouts (``trainer.rollout_mode: fully_async``, docs/async.md): generation never waits for
a step to end.

A producer (a thread on the main rank) generates chunks of groups – each one ``collect`` call: rewards,
advantages, dynamic sampling and over-sampling as in a synchronous step – into a bounded buffer of finished
groups, as long as the buffer has room. Every group is tagged with the policy version the engine held when its
generation started; each response token carries a version (``Sample.token_versions`` when the engine reports
them for partial rollouts, else the group's). At RL step ``v`` (the trainer's weights are version ``v``) the
trainer takes the oldest ``prompts_per_step`` groups whose tokens are at most ``trainer.max_staleness`` versions
behind; an older group is dropped (``trainer.stale_groups: drop``) or trained all the same with
``algorithm.correction`` weighting its tokens by ``π_prox / π_b`` (``correct``). A weight update after the step
that would wait for the chunk in flight pauses the engine instead (``trainer.pause_mode``, SGLang's
``/pause_generation``), syncs, and continues: the samples in flight span the update and come back with per-token
versions (partial rollouts). The engine counts its weights its own way (every update, bucket or initial sync);
the pipeline maps each engine version to the trainer's policy version that it served. ``pause_mode: none`` waits
for the chunk in flight (whole samples).

``trainer.fully_async_deterministic``: no thread – before each step the producer fills the buffer, chunk after
chunk, at the current version. Staleness then follows from counts alone (tests assert exact numbers).

Resume: a checkpoint holds the buffer (``rollout_buffer.pt``: every finished group, its versions and rollout
metrics, the prompt order after the last chunk); the producer is paused while it is written, so no chunk is half
done. A resumed run trains the buffered groups first and draws new prompts after them: no group is trained twice
and none is lost. Regenerating the buffer instead would need the older weights that sampled it.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from sapo_megatron.algo.decoupled import partial_sample_metrics
from sapo_megatron.data.prompts import PromptIterator
from sapo_megatron.errors import UserError
from sapo_megatron.loop.engine_gate import EngineGate
from sapo_megatron.loop.pipeline import RolloutPipeline, _pack, _unpack, sequence_staleness, with_versions
from sapo_megatron.loop.session import Session
from sapo_megatron.model.batching import TrainSequence
from sapo_megatron.runtime.interrupts import WaitInterrupted
from sapo_megatron.runtime.ranks import on_main_rank

logger = logging.getLogger(__name__)

BUFFER_FILE = "rollout_buffer.pt"
"""The fully-async buffer inside a training-state checkpoint (written by the main rank, read on resume)."""
_FORMAT = 1

GenerateChunk = Callable[[int, int], tuple[list[TrainSequence], dict[str, float], dict[str, Any]]]
"""``generate(index, groups)``: chunk ``index`` (0-based, its sampling seed) of ``groups`` prompt groups – the
sequences (``n_samples`` per group, group after group), their rollout metrics and the prompt order after them."""


class BufferResumeError(UserError):
    """A checkpoint's rollout buffer that this run cannot continue."""


@dataclass
class Group:
    """One finished prompt group: its sequences (each with per-token ``versions``), the version its generation
    started with, and the rollout metrics of the chunk it came from."""

    sequences: list[TrainSequence]
    version: int
    metrics: dict[str, float]

    def staleness(self, trainer_version: int) -> int:
        """Versions the oldest token is behind ``trainer_version``."""
        oldest = min((min(s.versions) for s in self.sequences if s.versions), default=self.version)
        return trainer_version - oldest


@dataclass(frozen=True)
class AsyncSettings:
    groups_per_step: int
    n_samples: int
    max_staleness: int
    stale_groups: str  # drop | correct
    chunk_groups: int
    capacity: int  # groups the buffer holds at most
    total_steps: int
    deterministic: bool
    pause_mode: str = "none"  # in_place | retract | abort | none
    inflight_chunks: int = 1  # chunks the producer generates at once (threaded mode)


class FullyAsyncPipeline:
    """The RL loop's source of batches under ``rollout_mode: fully_async``; the same calls as
    :class:`~sapo_megatron.loop.pipeline.RolloutPipeline` (``next_batch``, ``push_weights``, a context manager)."""

    def __init__(
        self,
        session: Session,
        prompts: PromptIterator,
        generate: GenerateChunk,
        settings: AsyncSettings,
        *,
        start_step: int,
    ) -> None:
        self.session, self.prompts, self.settings = session, prompts, settings
        self._generate = generate
        self.version = start_step  # the engine holds the weights of start_step before the first step
        self.trainer_version = start_step
        self._buffer: deque[Group] = deque()
        self._cond = threading.Condition()
        self._engine = EngineGate()  # shared by the chunks' generations, exclusive for a weight update
        self._next_chunk = 0
        self._running = 0  # groups being generated
        self._flight: dict[int, int] = {}  # chunk in flight -> the engine version when it was admitted
        self._taken = start_step * settings.groups_per_step  # groups handed to the trainer
        self._pause = False
        self._push_pending = False
        self._stopping = False
        self._error: BaseException | None = None
        self._failed = False  # a worker failed: no chunk starts any more
        self._threads: list[threading.Thread] = []
        self._trainer_idle = 0.0
        self._labels: dict[int, int] = {}  # engine weight version -> the policy version it served
        if session.info.is_main:
            self._label()
        checkpoint = session.start.checkpoint
        if session.start.resume and checkpoint is not None:
            on_main_rank(session.info, lambda: self._load(Path(checkpoint.path)))
        if session.checkpointer is not None:
            session.checkpointer.attachments[BUFFER_FILE] = self._payload

    # -- the two calls of a step ------------------------------------------------------------------------

    def next_batch(self, step: int) -> tuple[list[TrainSequence], dict[str, float]]:
        """Every rank: the groups to train at RL step ``step`` and their metrics (from the main rank)."""
        return on_main_rank(self.session.info, lambda: self._take(step))

    def push_weights(self, module: torch.nn.Module) -> dict[str, float]:
        """Every rank, after the step's updates: push the weights to the engine, or defer the push while a chunk is
        in flight and the engine is fewer than ``max_staleness`` versions behind (the next step's push sends the
        newer weights); otherwise wait for the chunk in flight."""
        self.trainer_version += 1
        may_defer = (
            self.trainer_version - self.version < self.settings.max_staleness and not self._engine_needed()
        )
        start = time.perf_counter()
        how = on_main_rank(self.session.info, lambda: self._lock_engine(wait=not may_defer))
        if how == "deferred":
            return {
                "weight_sync/deferred": 1.0,
                "async/engine_lag": float(self.trainer_version - self.version),
            }
        paused = how == "paused"
        try:
            self._trainer_idle += time.perf_counter() - start
            try:
                metrics = self.session.sync.push(module)
            except (
                WaitInterrupted
            ):  # a signal during the sync: end_of_step checkpoints and stops (resume re-syncs)
                metrics = {"weight_sync/interrupted": 1.0}
            with self._cond:
                self.version = self.trainer_version
                if self.session.info.is_main:
                    self._label()
        finally:
            if self.session.info.is_main:
                try:
                    if paused:
                        self._rollout().continue_generation()
                finally:
                    self._engine.end_update()
            with self._cond:
                self._push_pending = False
                self._cond.notify_all()
        return {
            **metrics,
            "weight_sync/deferred": 0.0,
            "weight_sync/paused": float(paused),
            "async/engine_lag": 0.0,
        }

    def _rollout(self) -> Any:
        if self.session.rollout is None:
            raise RuntimeError(
                "the fully-async pipeline runs on the main rank, which holds the rollout engine"
            )
        return self.session.rollout

    def _served(self) -> int | None:
        """Main rank: the engine's own number of the weights it serves (None: it reports no per-token versions)."""
        return None if self.session.rollout is None else self.session.rollout.served_weight_version()

    def _label(self) -> None:
        """Main rank: the engine's weights now are the policy version ``self.version`` (a push that left the
        engine's number as it was changed nothing there: its tokens keep the older label)."""
        served = self._served()
        if served is not None:
            self._labels.setdefault(served, self.version)

    def _policy_versions(self, sequences: list[TrainSequence]) -> list[TrainSequence]:
        """The engine's per-token versions (partial rollouts) as policy versions (an engine version seen by no
        label – none is, since generation is paused while a sync counts up – takes the latest label before it)."""
        with self._cond:
            labels = sorted(self._labels.items())
        if not labels:  # an engine that reports no number: its versions are taken as they are
            return sequences

        def policy(engine_version: int) -> int:
            known = [v for e, v in labels if e <= engine_version]
            if not known:
                raise RuntimeError(f"engine weight version {engine_version} predates the run's first label")
            return known[-1]

        return [
            s if s.versions is None else dataclasses.replace(s, versions=[policy(v) for v in s.versions])
            for s in sequences
        ]

    def _engine_needed(self) -> bool:
        """The engine must hold the trainer's weights after this step: the last one, or one evaluated after it."""
        every = getattr(getattr(self.session.cfg, "eval", None), "every", 0)
        step = self.trainer_version
        return step >= self.settings.total_steps or (bool(every) and step % every == 0)

    def _lock_engine(self, *, wait: bool) -> str:
        """Main rank: take the engine for a weight update – ``locked`` (no chunk in flight, or after waiting for
        all of them), ``paused`` (the chunks in flight paused in ``pause_mode``, once for all) or ``deferred``
        (``wait`` false); while it waits or pauses, the producer starts no further chunk."""
        if self._engine.try_update():
            return "locked"
        if not wait:
            return "deferred"
        with self._cond:
            self._push_pending = True
        if self.settings.pause_mode != "none" and self._served() is not None:
            self._engine.begin_update(wait_for_chunks=False)  # no chunk enters; those inside are paused
            try:
                self._rollout().pause_generation(self.settings.pause_mode)
            except BaseException:
                self._engine.end_update()
                with self._cond:  # the run fails with the engine's error; the producer may start chunks again
                    self._push_pending = False
                    self._cond.notify_all()
                raise
            return "paused"
        self._engine.begin_update(wait_for_chunks=True)
        return "locked"

    # -- the trainer's side (main rank) -----------------------------------------------------------------

    def _take(self, step: int) -> tuple[list[TrainSequence], dict[str, float]]:
        cfg = self.settings
        if cfg.deterministic:
            self._fill()
        elif not self._threads:
            self._start_workers()
        taken: list[Group] = []
        dropped = kept_stale = 0
        start = time.perf_counter()
        with self._cond:
            fill = len(self._buffer)
            while len(taken) < cfg.groups_per_step:
                while not self._buffer:
                    self._raise_error()
                    if cfg.deterministic:  # groups were dropped: generate their replacements now
                        self._fill()
                        if not self._buffer:
                            raise RuntimeError("the deterministic producer has no room to refill the buffer")
                        continue
                    self._cond.wait(timeout=1.0)
                group = self._buffer.popleft()
                if group.staleness(step) > cfg.max_staleness:
                    if cfg.stale_groups == "drop":
                        dropped += 1
                        continue
                    kept_stale += 1
                taken.append(group)
                self._taken += 1
            self._cond.notify_all()
        self._trainer_idle += time.perf_counter() - start
        metrics = self._metrics(taken, step, fill=fill, dropped=dropped, kept_stale=kept_stale)
        return [s for group in taken for s in group.sequences], metrics

    def _metrics(
        self, taken: list[Group], step: int, *, fill: int, dropped: int, kept_stale: int
    ) -> dict[str, float]:
        metrics = _mean_metrics([group.metrics for group in taken])
        trained = [s for group in taken for s in group.sequences]
        metrics.update(sequence_staleness(trained, step, buckets=max(self.settings.max_staleness, 1)))
        partial = partial_sample_metrics([s.versions or () for s in trained])
        metrics.update({name: float(value) for name, value in partial.items()})
        metrics["rollout/staleness"] = float(sum(g.staleness(step) for g in taken) / max(len(taken), 1))
        metrics["async/stale_dropped_groups"] = float(dropped)
        metrics["async/stale_dropped_frac"] = dropped / (dropped + len(taken))
        metrics["async/stale_kept_groups"] = float(kept_stale)
        metrics["async/buffer_groups"] = float(fill)
        metrics["async/buffer_fill"] = fill / self.settings.capacity
        metrics["time/generation_idle_s"] = self._engine.take_idle_s()  # no chunk generating (threaded mode)
        metrics["time/trainer_idle_s"], self._trainer_idle = self._trainer_idle, 0.0
        return metrics

    # -- the producer (main rank) -----------------------------------------------------------------------

    def _room(self) -> int:
        """Groups the producer may start now: the buffer's free space, no more than the run still needs, and under
        ``stale_groups: drop`` none that the bound would drop – a chunk admitted at version v is trained by step
        v + max_staleness (AReaL's admission rule, counted in groups). Chunks finish in any order, so a new chunk
        may end up ahead of every chunk in flight: the rule counts from the oldest version among them."""
        cfg = self.settings
        if self._pause or self._stopping or self._push_pending or self._failed:
            return 0
        ahead = len(self._buffer) + self._running
        room = min(cfg.capacity - ahead, cfg.total_steps * cfg.groups_per_step - self._taken - ahead)
        if cfg.stale_groups == "drop":
            oldest = min(self._flight.values(), default=self.version)
            in_bound = (oldest + cfg.max_staleness + 1) * cfg.groups_per_step - self._taken - ahead
            room = min(room, in_bound)
        return room

    def _admit(self, groups: int) -> int:
        """Under ``_cond``: the next chunk's index, counted in flight."""
        index, self._next_chunk = self._next_chunk, self._next_chunk + 1
        self._running += groups
        self._flight[index] = self.version
        return index

    def _fill(self) -> None:
        """Deterministic mode: chunks at the current version until the buffer is full, one at a time."""
        while self._room() > 0:
            with self._cond:
                groups = min(self.settings.chunk_groups, self._room())
                index = self._admit(groups)
            self._chunk(index, groups)

    def _start_workers(self) -> None:
        """``inflight_chunks`` producer threads, each generating one chunk at a time."""
        self._engine.start_idle_clock()
        for _ in range(self.settings.inflight_chunks):
            thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _produce(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._room() <= 0 and not (self._stopping or self._failed):
                        self._cond.wait()
                    if self._stopping or self._failed:
                        return
                    groups = min(self.settings.chunk_groups, self._room())
                    index = self._admit(groups)
                self._chunk(index, groups)
        # kept for the trainer, which re-raises the first worker's at its next wait
        except BaseException as exc:
            with self._cond:
                if self._failed:
                    logger.error("another rollout worker failed too: %s: %s", type(exc).__name__, exc)
                else:
                    self._error, self._failed = exc, True
                self._cond.notify_all()

    def _chunk(self, index: int, groups: int) -> None:
        """Generate admitted chunk ``index``; its groups enter the buffer when it finishes (in order of
        completion)."""
        finished: list[Group] = []
        try:
            # waits for a weight update in progress; an update waits for (or pauses) the chunks inside
            with self._engine.chunk():
                with self._cond:
                    version = self.version
                sequences, metrics, _ = self._generate(index, groups)
            sequences = with_versions(self._policy_versions(sequences), version)
            n = self.settings.n_samples
            finished = [Group(sequences[g : g + n], version, metrics) for g in range(0, len(sequences), n)]
        finally:  # a failed chunk is no longer in flight either: a checkpoint must not wait for it
            with self._cond:
                self._running -= groups
                self._flight.pop(index, None)
                self._buffer.extend(finished)
                self._cond.notify_all()

    def _raise_error(self) -> None:
        """The first failed worker's error, once; later waits fail without repeating it (nothing generates)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._failed:
            raise RuntimeError(
                "the rollout producer stopped after an error (raised before); the run cannot go on"
            )

    # -- checkpoints ------------------------------------------------------------------------------------

    @contextmanager
    def _paused(self) -> Iterator[None]:
        """The producer stopped between chunks (none in flight) for as long as this holds."""
        with self._cond:
            self._pause = True
            while self._running:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._pause = False
                self._cond.notify_all()

    def _payload(self) -> bytes | None:
        if not self.session.info.is_main:
            return None
        with self._paused():
            state = {
                "format": _FORMAT,
                "version": self.trainer_version,
                "next_chunk": self._next_chunk,
                "prompt_state": self.prompts.state_dict(),
                "groups": [
                    {
                        "version": g.version,
                        "metrics": dict(g.metrics),
                        "sequences": [
                            {f.name: _pack(getattr(s, f.name)) for f in dataclasses.fields(TrainSequence)}
                            for s in g.sequences
                        ],
                    }
                    for g in self._buffer
                ],
            }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def _load(self, checkpoint: Path) -> None:
        path = checkpoint / BUFFER_FILE
        if not path.exists():
            return
        state = torch.load(path, weights_only=True)
        if state.get("format") != _FORMAT or state.get("version") != self.version:
            raise BufferResumeError(
                f"{path} holds the rollout buffer of policy version {state.get('version')} (format "
                f"{state.get('format')}), but the checkpoint resumes at version {self.version}",
                hint="the checkpoint directory was edited or mixed with another run's files; resume from an intact "
                "checkpoint",
            )
        self._next_chunk = int(state["next_chunk"])
        self.prompts.load_state_dict(dict(state["prompt_state"]))
        for g in state["groups"]:
            sequences = [TrainSequence(**{k: _unpack(v) for k, v in s.items()}) for s in g["sequences"]]
            self._buffer.append(Group(sequences, int(g["version"]), dict(g["metrics"])))

    # -- context manager --------------------------------------------------------------------------------

    def __enter__(self) -> FullyAsyncPipeline:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.session.checkpointer is not None:
            self.session.checkpointer.attachments.pop(BUFFER_FILE, None)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + min(self.session.cfg.rollout.timeout_s, 60.0)
        for thread in self._threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        if any(thread.is_alive() for thread in self._threads):
            logger.warning("the rollout producer is still generating a chunk; leaving it")
        if self._error is not None and exc is not None:
            logger.error("the rollout producer failed too: %s: %s", type(self._error).__name__, self._error)


def _mean_metrics(chunks: list[dict[str, float]]) -> dict[str, float]:
    """The rollout metrics of the trained groups: each chunk's, weighted by its groups among them."""
    keys = {key for chunk in chunks for key in chunk}
    return {key: sum(chunk.get(key, 0.0) for chunk in chunks) / len(chunks) for key in sorted(keys)}


def async_settings(cfg: Any) -> AsyncSettings:
    """The pipeline's settings from the run config."""
    trainer = cfg.trainer
    per_step = trainer.prompts_per_step
    return AsyncSettings(
        groups_per_step=per_step,
        n_samples=cfg.rollout.n_samples,
        max_staleness=trainer.max_staleness,
        stale_groups=trainer.stale_groups,
        chunk_groups=trainer.async_chunk_groups or per_step,
        capacity=trainer.async_buffer_groups or (trainer.max_staleness + 1) * per_step,
        total_steps=trainer.steps,
        deterministic=trainer.fully_async_deterministic,
        pause_mode=trainer.pause_mode,
        inflight_chunks=trainer.async_inflight_chunks,
    )


def open_rollouts(
    session: Session,
    prompts: PromptIterator,
    generate: GenerateChunk,
    *,
    start_step: int,
) -> RolloutPipeline | FullyAsyncPipeline:
    """The RL loop's batches for ``trainer.rollout_mode``: generated each step (sync), one step ahead
    (one_step_off), or continuously within the staleness bound (fully_async)."""
    cfg = session.cfg
    if cfg.trainer.rollout_mode == "fully_async":
        return FullyAsyncPipeline(session, prompts, generate, async_settings(cfg), start_step=start_step)
    return RolloutPipeline(
        session,
        prompts,
        lambda step: generate(step, cfg.trainer.prompts_per_step),
        start_step=start_step,
        total_steps=cfg.trainer.steps,
        overlap=cfg.trainer.rollout_mode == "one_step_off",
    )
