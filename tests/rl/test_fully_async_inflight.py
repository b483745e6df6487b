"""The fully-async producer with several chunks in flight (``trainer.async_inflight_chunks``, loop/fully_async.py):
chunks enter the buffer in the order they finish, a weight update waits for or pauses all of them, the staleness
of the groups trained after a pause is exact, one worker's error is raised once, and a checkpoint taken while
chunks are in flight neither loses nor repeats a prompt. The stand-in ``generate`` is held with events, so every
order asserted here is forced, not timed."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from sapo_megatron.data.prompts import PromptIterator, PromptRow
from sapo_megatron.loop.fully_async import BUFFER_FILE, AsyncSettings, FullyAsyncPipeline
from sapo_megatron.model.batching import TrainSequence
from sapo_megatron.rollout.base import RolloutError

WAIT_S = 30.0


def settings(**changes) -> AsyncSettings:
    base = dict(
        groups_per_step=1,
        n_samples=1,
        max_staleness=1,
        stale_groups="drop",
        chunk_groups=1,
        capacity=4,
        total_steps=4,
        deterministic=False,
        inflight_chunks=2,
    )
    return AsyncSettings(**{**base, **changes})


class Engine:
    """A stand-in rollout engine that counts its weights and records pause / continue."""

    def __init__(self) -> None:
        self.served = 0
        self.calls: list[str] = []
        self.continued = threading.Event()

    def served_weight_version(self) -> int:
        return self.served

    def pause_generation(self, mode: str) -> None:
        self.calls.append(f"pause {mode}")

    def continue_generation(self) -> None:
        self.calls.append("continue")
        self.continued.set()


def session(
    *, engine: Engine | None = None, pushes: list[int] | None = None, every: int = 0
) -> SimpleNamespace:
    pushes = [] if pushes is None else pushes

    def push(module) -> dict:
        pushes.append(1)
        if engine is not None:
            engine.served += 1
        return {}

    return SimpleNamespace(
        cfg=SimpleNamespace(rollout=SimpleNamespace(timeout_s=5.0), eval=SimpleNamespace(every=every)),
        info=SimpleNamespace(is_main=True),
        start=SimpleNamespace(resume=False, checkpoint=None),
        checkpointer=None,
        sync=SimpleNamespace(push=push),
        rollout=engine,
    )


def marked(index: int, groups: int, versions: list[int] | None = None) -> list[TrainSequence]:
    """``groups`` one-sample groups whose last response token names the chunk."""
    return [TrainSequence([1], [2, index], versions=versions) for _ in range(groups)]


def chunk_of(sequences: list[TrainSequence]) -> list[int]:
    return [s.response_ids[-1] for s in sequences]


def wait(event: threading.Event, what: str) -> None:
    assert event.wait(WAIT_S), f"timed out waiting for {what}"


def test_a_short_chunk_started_after_a_long_one_enters_the_buffer_first():
    long_started, release_long = threading.Event(), threading.Event()

    def generate(index, groups):
        if index == 0:  # the long chunk: still generating when the trainer takes its first batch
            long_started.set()
            wait(release_long, "the test to release chunk 0")
        return marked(index, groups), {}, {}

    with FullyAsyncPipeline(session(), None, generate, settings(), start_step=0) as pipeline:
        sequences, metrics = pipeline.next_batch(0)
        assert long_started.is_set() and not release_long.is_set()
        assert chunk_of(sequences) == [1]  # chunk 1 started after chunk 0 and is trained first
        assert pipeline._running == 1 and list(pipeline._flight) == [0]
        release_long.set()
        pipeline.push_weights(None)  # max_staleness 1: not deferred, waits for chunk 0
        sequences, metrics = pipeline.next_batch(1)
        assert chunk_of(sequences) == [0]
        assert metrics["staleness/token_max"] == 1.0 and metrics["rollout/staleness"] == 1.0


def test_a_weight_update_waits_for_every_chunk_in_flight():
    """``pause_mode: none`` (or an engine without versions): the update waits for both chunks in flight."""
    entered = {1: threading.Event(), 2: threading.Event()}
    release = {1: threading.Event(), 2: threading.Event()}
    started: list[int] = []

    def generate(index, groups):
        started.append(index)
        if index in entered:
            entered[index].set()
            wait(release[index], f"the test to release chunk {index}")
        return marked(index, groups), {}, {}

    pushes: list[int] = []
    cfg = settings(max_staleness=2, capacity=3, total_steps=3)  # up to 3 groups ahead at version 0
    with FullyAsyncPipeline(session(pushes=pushes, every=1), None, generate, cfg, start_step=0) as pipeline:
        sequences, _ = pipeline.next_batch(0)
        assert chunk_of(sequences) == [0]
        wait(entered[1], "chunk 1")
        wait(entered[2], "chunk 2")
        assert pipeline._engine.chunks == 2
        pushed = threading.Event()
        result: dict = {}

        def update() -> None:
            result.update(pipeline.push_weights(None))  # eval after every step: the update may not defer
            pushed.set()

        threading.Thread(target=update, daemon=True).start()
        release[1].set()
        with pipeline._cond:  # chunk 1 finishes; the update still waits for chunk 2
            assert pipeline._cond.wait_for(lambda: pipeline._running == 1 and pipeline._push_pending, WAIT_S)
        assert not pushed.is_set() and pushes == [] and started == [0, 1, 2]
        release[2].set()
        wait(pushed, "the weight update")
        assert pushes == [1] and result["weight_sync/paused"] == 0.0 and pipeline.version == 1
        sequences, metrics = pipeline.next_batch(1)
        assert chunk_of(sequences) == [1] and metrics["staleness/token_max"] == 1.0


def test_a_weight_update_pauses_every_chunk_in_flight_once_and_their_staleness_is_exact():
    """``pause_mode: in_place``: both chunks in flight are paused by one ``pause_generation``, the weights are
    pushed beside them and generation continues; each sample's first token is of version 0, its second of
    version 1 (the engine's own numbers mapped to policy versions), so step 1 trains tokens 1 and 0 versions
    behind."""
    engine = Engine()
    entered = {2: threading.Event(), 3: threading.Event()}

    def generate(index, groups):
        if index not in entered:
            return marked(index, groups), {}, {}
        first = engine.served  # the token sampled before the pause
        entered[index].set()
        wait(engine.continued, "continue_generation")
        return marked(index, groups, versions=[first, engine.served]), {}, {}

    pushes: list[int] = []
    cfg = settings(groups_per_step=2, total_steps=2, pause_mode="in_place")
    with FullyAsyncPipeline(
        session(engine=engine, pushes=pushes), None, generate, cfg, start_step=0
    ) as pipeline:
        sequences, _ = pipeline.next_batch(0)
        assert sorted(chunk_of(sequences)) == [0, 1]
        wait(entered[2], "chunk 2")
        wait(entered[3], "chunk 3")
        result = pipeline.push_weights(None)
        assert engine.calls == ["pause in_place", "continue"] and pushes == [1]
        assert result["weight_sync/paused"] == 1.0
        sequences, metrics = pipeline.next_batch(1)
        assert sorted(chunk_of(sequences)) == [2, 3]
        assert [s.versions for s in sequences] == [[0, 1], [0, 1]]
        assert metrics["staleness/token_mean"] == 0.5 and metrics["staleness/token_max"] == 1.0
        assert metrics["staleness/sample_mean"] == 1.0 and metrics["staleness/tokens_1"] == 0.5
        assert metrics["async/partial_samples_frac"] == 1.0 and metrics["rollout/staleness"] == 1.0
        pipeline.push_weights(None)  # nothing in flight: the last update neither waits nor pauses
    assert engine.calls == ["pause in_place", "continue"] and pushes == [1, 1]


def test_no_chunk_is_admitted_that_would_push_an_older_chunk_in_flight_past_the_bound():
    """Chunks finish in any order, so under ``stale_groups: drop`` the admission rule counts from the oldest chunk
    in flight: chunk 0 spans a paused update (its tokens start at version 0) and is still generating at version 1;
    a chunk admitted now could be trained before it and leave it 2 versions behind at step 2 (dropped). So none is
    admitted until chunk 0 finishes, and chunk 0 is trained at step 1, one version behind."""
    engine, entered, hold = Engine(), threading.Event(), threading.Event()

    def generate(index, groups):
        if index != 0:
            return marked(index, groups), {}, {}
        first = engine.served
        entered.set()
        wait(hold, "the test to release chunk 0")
        return marked(index, groups, versions=[first, engine.served]), {}, {}

    cfg = settings(pause_mode="in_place", total_steps=3)
    with FullyAsyncPipeline(session(engine=engine), None, generate, cfg, start_step=0) as pipeline:
        sequences, _ = pipeline.next_batch(0)
        assert chunk_of(sequences) == [1]
        wait(entered, "chunk 0")
        assert pipeline.push_weights(None)["weight_sync/paused"] == 1.0
        with pipeline._cond:
            assert pipeline.version == 1 and list(pipeline._flight.items()) == [(0, 0)]
            assert pipeline._room() == 0  # counted from version 0, not the engine's 1
        hold.set()
        sequences, metrics = pipeline.next_batch(1)
        assert chunk_of(sequences) == [0] and sequences[0].versions == [0, 1]
        assert metrics["async/stale_dropped_groups"] == 0.0 and metrics["staleness/token_max"] == 1.0


def test_an_error_in_one_worker_is_raised_once(caplog):
    both_in = threading.Barrier(2)

    def generate(index, groups):
        both_in.wait(timeout=WAIT_S)  # both chunks in flight, then both fail
        raise RolloutError(f"injected in chunk {index}")

    pipeline = FullyAsyncPipeline(session(), None, generate, settings(groups_per_step=2), start_step=0)
    with caplog.at_level(logging.ERROR, logger="sapo_megatron.loop.fully_async"), pipeline:
        with pytest.raises(RolloutError, match=r"injected in chunk [01]") as first:
            pipeline.next_batch(0)
        with pipeline._cond:
            assert pipeline._cond.wait_for(lambda: pipeline._running == 0, WAIT_S)
        with pytest.raises(RuntimeError, match="the rollout producer stopped after an error"):
            pipeline.next_batch(0)  # no hang, and not the same error again
    other = "1" if str(first.value).endswith("0") else "0"
    failed_too = [r.getMessage() for r in caplog.records if "failed too" in r.getMessage()]
    assert failed_too == [f"another rollout worker failed too: RolloutError: injected in chunk {other}"]
    assert pipeline._next_chunk == 2  # no chunk started after the failures


def test_a_checkpoint_with_chunks_in_flight_neither_loses_nor_repeats_a_prompt(tmp_path):
    """K = 2 with a real prompt iterator: the payload is written once no chunk is in flight; the groups trained
    before it, the groups it buffers and the groups a resumed pipeline generates after it are every prompt of the
    run exactly once, in the iterator's order of drawing."""
    rows = [PromptRow(prompt=f"p{i}", ground_truth=str(i)) for i in range(100)]
    slow = threading.Event()  # chunk 1 is slow: the chunks after it overtake it
    slow_prompt: list[int] = []

    def generator(prompts: PromptIterator):
        def generate(index, groups):
            drawn = prompts.take(groups)
            if index == 1 and not slow.is_set():
                slow_prompt.extend(int(r.ground_truth) for r in drawn)
                wait(slow, "chunk 1's release")
            return [TrainSequence([1], [2, int(r.ground_truth)]) for r in drawn], {}, {}

        return generate

    def new_prompts() -> PromptIterator:
        return PromptIterator(rows, batch_size=2, seed=0, shuffle=False)

    run = session()
    run.checkpointer = SimpleNamespace(attachments={})
    cfg = settings(groups_per_step=2, max_staleness=2, capacity=6, total_steps=6, pause_mode="none")
    prompts = new_prompts()
    trained: list[int] = []
    with FullyAsyncPipeline(run, prompts, generator(prompts), cfg, start_step=0) as pipeline:
        sequences, _ = pipeline.next_batch(0)
        trained += chunk_of(sequences)
        slow.set()
        pipeline.push_weights(None)
        sequences, _ = pipeline.next_batch(1)
        trained += chunk_of(sequences)
        pipeline.push_weights(None)
        payload = run.checkpointer.attachments[BUFFER_FILE]()
    assert slow_prompt and slow_prompt[0] not in trained[:2]  # chunk 1 was overtaken
    checkpoint = tmp_path / "step_000002"
    checkpoint.mkdir()
    (checkpoint / BUFFER_FILE).write_bytes(payload)
    resumed = session()
    resumed.start = SimpleNamespace(resume=True, checkpoint=SimpleNamespace(path=str(checkpoint)))
    prompts = new_prompts()
    with FullyAsyncPipeline(resumed, prompts, generator(prompts), cfg, start_step=2) as pipeline:
        for step in range(2, 6):
            sequences, _ = pipeline.next_batch(step)
            trained += chunk_of(sequences)
            pipeline.push_weights(None)
    assert sorted(trained) == list(range(12))  # 6 steps x 2 groups: each prompt once


def test_the_engine_gate_keeps_chunks_out_of_an_update_and_counts_idle_time_without_chunks():
    from sapo_megatron.loop.engine_gate import EngineGate

    gate = EngineGate()
    assert gate.take_idle_s() == 0.0  # the clock has not started
    with gate.chunk():
        gate.start_idle_clock()
        assert not gate.try_update()  # a chunk is inside
        assert gate.take_idle_s() == 0.0  # a chunk was inside the whole time
    assert gate.try_update()
    entered = threading.Event()

    def chunk() -> None:
        with gate.chunk():
            entered.set()

    waiting = threading.Thread(target=chunk, daemon=True)
    waiting.start()
    assert not entered.wait(0.05) and gate.chunks == 0  # held out while the update is in progress
    with pytest.raises(RuntimeError, match="already in progress"):
        gate.begin_update(wait_for_chunks=False)
    gate.end_update()
    wait(entered, "the chunk after the update")
    waiting.join(WAIT_S)
    assert gate.take_idle_s() > 0.0  # no chunk inside during the update
