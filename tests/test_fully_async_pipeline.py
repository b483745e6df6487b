"""The fully-async pipeline without a trainer (loop/fully_async.py): the producer thread's errors reach the loop,
engine-reported per-token versions are kept, groups beyond the bound are dropped, and the buffer never holds more
than its capacity."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from sapo_megatron.loop.fully_async import AsyncSettings, FullyAsyncPipeline
from sapo_megatron.model.batching import TrainSequence
from sapo_megatron.rollout.base import RolloutError


def session(pushes: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        cfg=SimpleNamespace(rollout=SimpleNamespace(timeout_s=5.0)),
        info=SimpleNamespace(is_main=True),
        start=SimpleNamespace(resume=False, checkpoint=None),
        checkpointer=None,
        sync=SimpleNamespace(push=lambda module: pushes.append(1) or {}),
        rollout=None,  # no engine: updates wait for the chunk in flight
    )


def settings(**changes) -> AsyncSettings:
    base = dict(
        groups_per_step=2,
        n_samples=1,
        max_staleness=1,
        stale_groups="drop",
        chunk_groups=2,
        capacity=4,
        total_steps=5,
        deterministic=False,
    )
    return AsyncSettings(**{**base, **changes})


def test_an_error_in_the_producer_is_raised_in_the_loop():
    def generate(index, groups):
        if index == 2:
            raise RolloutError("injected: the engine went away")
        return [TrainSequence([1], [2, 3]) for _ in range(groups)], {}, {}

    with FullyAsyncPipeline(session([]), None, generate, settings(), start_step=0) as pipeline:
        pipeline.next_batch(0)
        pipeline.push_weights(None)
        with pytest.raises(RolloutError, match="injected"):  # chunks 0 and 1 trained, then chunk 2's error
            for step in range(1, 5):
                pipeline.next_batch(step)
                pipeline.push_weights(None)


def test_engine_versions_are_kept_and_the_bound_holds_with_a_fast_producer():
    seen_capacity: list[float] = []

    def generate(index, groups):
        partial = TrainSequence([1], [2, 3, 4], versions=[0, 0, 1])  # paused across the first update
        rest = [TrainSequence([1], [2, 3]) for _ in range(groups - 1)]
        return ([partial] if index == 0 else [TrainSequence([1], [2, 3])]) + rest, {"reward/mean": 1.0}, {}

    pushes: list[int] = []
    pipeline = FullyAsyncPipeline(session(pushes), None, generate, settings(), start_step=0)
    with pipeline:
        staleness = []
        for step in range(5):
            sequences, metrics = pipeline.next_batch(step)
            seen_capacity.append(metrics["async/buffer_groups"])
            if step == 0:
                assert sequences[0].versions == [0, 0, 1]  # the engine's versions, not overwritten
            assert all(s.versions is not None and len(s.versions) == len(s.response_ids) for s in sequences)
            staleness.append(metrics["staleness/token_max"])
            time.sleep(0.02)  # the producer fills the buffer meanwhile
            pipeline.push_weights(None)
    assert len(pushes) == 5
    assert max(staleness) <= 1.0
    assert max(seen_capacity) <= 4
    assert metrics["reward/mean"] == 1.0
    assert not any(t.name == "rollout-producer" and t.is_alive() for t in threading.enumerate())


def test_groups_past_the_bound_are_dropped_and_replaced():
    """Under drop the producer starts no chunk the bound would drop, so only an engine's own versions can make a
    group stale: chunk 1 comes back sampled at version 0 (a partial rollout continued), step 1 drops it and the
    deterministic producer generates its replacement at once."""

    def generate(index, groups):
        versions = [0] if index == 1 else None
        return [TrainSequence([1], [2], versions=versions) for _ in range(groups)], {}, {}

    pipeline = FullyAsyncPipeline(
        session([]),
        None,
        generate,
        settings(max_staleness=0, deterministic=True, total_steps=3),
        start_step=0,
    )
    with pipeline:
        dropped, staleness = [], []
        for step in range(3):
            _, metrics = pipeline.next_batch(step)
            dropped.append(metrics["async/stale_dropped_groups"])
            staleness.append(metrics["staleness/token_max"])
            pipeline.push_weights(None)
    assert dropped == [0.0, 2.0, 0.0]
    assert staleness == [0.0, 0.0, 0.0]
    assert pipeline._next_chunk == 4  # chunks 0, 1 (dropped), 2 (its replacement), 3


def test_a_push_is_deferred_while_a_chunk_is_in_flight_within_the_bound():
    """max_staleness 3: a weight update that would wait for the chunk in flight is skipped while the engine is
    fewer than 3 versions behind (the next update sends the newer weights); the last step's update always goes
    through, and no token is trained more than 3 versions behind."""

    def generate(index, groups):
        time.sleep(0.05)  # generation is slower than this trainer, so a chunk is in flight at every update
        return [TrainSequence([1], [2, 3]) for _ in range(groups)], {}, {}

    pushes: list[int] = []
    cfg = settings(max_staleness=3, capacity=8, total_steps=8)
    with FullyAsyncPipeline(session(pushes), None, generate, cfg, start_step=0) as pipeline:
        deferred, lag, staleness = [], [], []
        for step in range(8):
            _, metrics = pipeline.next_batch(step)
            staleness.append(metrics["staleness/token_max"])
            pushed = pipeline.push_weights(None)
            deferred.append(pushed["weight_sync/deferred"])
            lag.append(pushed["async/engine_lag"])
    assert sum(deferred) >= 2 and len(pushes) == 8 - sum(deferred)
    assert max(lag) <= 2.0  # at 3 versions behind the update waits
    assert deferred[-1] == 0.0 and pipeline.version == pipeline.trainer_version == 8
    assert max(staleness) <= 3.0


def test_compare_grids_over_max_staleness(tmp_path):
    """``sapo-megatron compare --grid trainer.max_staleness=0,1,2,4`` with ``rollout_mode: fully_async``: one
    validated arm config per bound."""
    from sapo_megatron.compare import build_plan, parse_grid

    plan = build_plan(
        None,
        {"trainer.rollout_mode": "fully_async", "trainer.prompts_per_step": 4, "rollout.n_samples": 4},
        losses=["sapo"],
        replays=["none"],
        corrections=["none"],
        seeds=1,
        steps=3,
        output_dir=tmp_path,
        grid=parse_grid(["trainer.max_staleness=0,1,2,4"]),
    )
    assert [run.cfg.trainer.max_staleness for run in plan.arms] == [0, 1, 2, 4]
    assert {run.cfg.trainer.rollout_mode for run in plan.arms} == {"fully_async"}
    assert [run.name for run in plan.arms][-1] == "sapo-none-none-max_staleness4-s0"


class Prompts:
    """The prompt iterator's state, as the pipeline saves and restores it."""

    def __init__(self) -> None:
        self.state = {"position": 0}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def test_a_checkpoint_of_the_threaded_buffer_waits_for_the_chunk_in_flight_and_restores_it(tmp_path):
    """The payload is written with the producer paused between chunks: the saved prompt position, the next chunk's
    index and the buffered groups agree (every chunk started is finished and buffered or trained), and a resumed
    pipeline holds exactly those groups, with their versions."""
    from sapo_megatron.loop.fully_async import BUFFER_FILE

    prompts = Prompts()

    def generate(index, groups):
        time.sleep(0.05)
        prompts.state = {"position": (index + 1) * groups}  # what drawing the chunk's prompts did
        return [TrainSequence([1], [2, index]) for _ in range(groups)], {"reward/mean": float(index)}, {}

    run = session([])
    run.checkpointer = SimpleNamespace(attachments={})
    cfg = settings(max_staleness=2, capacity=6, total_steps=6)
    with FullyAsyncPipeline(run, prompts, generate, cfg, start_step=0) as pipeline:
        for step in range(2):
            pipeline.next_batch(step)
            pipeline.push_weights(None)
        payload = run.checkpointer.attachments[BUFFER_FILE]()  # while the producer generates
    checkpoint = tmp_path / "step_000002"
    checkpoint.mkdir()
    (checkpoint / BUFFER_FILE).write_bytes(payload)
    resumed = session([])
    resumed.start = SimpleNamespace(resume=True, checkpoint=SimpleNamespace(path=str(checkpoint)))
    restored_prompts = Prompts()
    pipeline = FullyAsyncPipeline(resumed, restored_prompts, generate, cfg, start_step=2)
    chunks = pipeline._next_chunk
    assert restored_prompts.state == {"position": 2 * chunks}  # the prompts of exactly the finished chunks
    buffered = [s.response_ids[1] for g in pipeline._buffer for s in g.sequences]
    assert len(buffered) == 2 * chunks - 4  # chunks x 2 groups, 4 of them trained in steps 0 and 1
    assert buffered == sorted(buffered) and (not buffered or buffered[-1] == chunks - 1)
    assert all(s.versions is not None for g in pipeline._buffer for s in g.sequences)


def test_a_checkpoint_after_a_failed_chunk_does_not_wait_for_it():
    from sapo_megatron.loop.fully_async import BUFFER_FILE

    def generate(index, groups):
        if index == 1:
            raise RolloutError("injected")
        return [TrainSequence([1], [2]) for _ in range(groups)], {}, {}

    run = session([])
    run.checkpointer = SimpleNamespace(attachments={})
    cfg = settings(capacity=2, total_steps=3, deterministic=True)
    with FullyAsyncPipeline(run, Prompts(), generate, cfg, start_step=0) as pipeline:
        pipeline.next_batch(0)
        pipeline.push_weights(None)
        with pytest.raises(RolloutError, match="injected"):
            pipeline.next_batch(1)
        assert pipeline._running == 0
        assert run.checkpointer.attachments[BUFFER_FILE]()  # written at once, nothing in flight
