"""The fully-async loop's weight update pauses the in-process CPU engine (``trainer.pause_mode``) instead of waiting
for the chunk in flight: a sample spans the update, its tokens carry the trainer's policy versions (not the
engine's own update count), and the step's staleness and partial-sample metrics see them. The chunk in flight is
held at a fixed token count (the engine's ``pause_after`` hook) until the pause is asked for, so the split is exact.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from sapo_megatron.loop.fully_async import AsyncSettings, FullyAsyncPipeline
from sapo_megatron.loop.versions import TokenStaleness
from sapo_megatron.model.batching import TrainSequence, build_micro_batches
from sapo_megatron.model.step_batch import StepBatch
from sapo_megatron.rollout.cpu.engine import CPUEngine
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams
from tests.rollout.conftest import make_dense_model

NEW_TOKENS = 10
HOLD_AT = 3  # the chunk in flight waits here for the pause; one more token is sampled before it parks
OLD = HOLD_AT + 1  # tokens made with the weights of policy version 0


class BucketedSync:
    """The trainer's weight sync: two buckets per push, so the engine counts two versions per policy version."""

    def __init__(self, engine: CPUEngine) -> None:
        self.engine, self.pushes = engine, 0

    def push(self, module: object) -> dict[str, float]:
        self.pushes += 1
        params = list(self.engine.model.named_parameters())
        half = len(params) // 2
        for bucket in (params[:half], params[half:]):
            self.engine.update_weights_from_tensors(
                [(name, p.detach() + 0.05 * torch.randn_like(p)) for name, p in bucket]
            )
        return {"weight_sync/s": 0.0}


def session(engine: CPUEngine) -> SimpleNamespace:
    return SimpleNamespace(
        info=SimpleNamespace(is_main=True),
        start=SimpleNamespace(resume=False, checkpoint=None),
        checkpointer=None,
        cfg=SimpleNamespace(eval=SimpleNamespace(every=0), rollout=SimpleNamespace(timeout_s=30.0)),
        sync=BucketedSync(engine),
        rollout=engine,
    )


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def run_two_steps(mode: str) -> tuple[list[list[TrainSequence]], list[dict[str, float]], CPUEngine]:
    torch.manual_seed(0)
    engine = CPUEngine(make_dense_model(0), num_threads=1)
    sess = session(engine)
    sess.sync.push(None)  # the run's initial sync: engine version 2 serves policy version 0
    reached = threading.Event()

    def hold() -> None:  # the chunk in flight, HOLD_AT tokens in: let the trainer's update find it
        reached.set()
        if mode != "none":
            wait_for(lambda: engine.pause_gate.paused, "the pipeline's pause")

    def generate(index: int, groups: int):
        if index == 1:
            engine.pause_after(HOLD_AT, "in_place", hold)
        sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=11 + index)
        requests = [
            GenerationRequest(prompt_ids=[3, 17, 5, 42 + g], n=2, sampling=sampling, group_id=g)
            for g in range(groups)
        ]
        samples = [s for group in engine.generate(requests) for s in group]
        assert all(len(s.response_ids) == NEW_TOKENS for s in samples)  # no early stop: the split is exact
        sequences = [
            TrainSequence(s.prompt_ids, s.response_ids, 1.0, s.rollout_logp, versions=s.token_versions)
            for s in samples
        ]
        return sequences, {"rollout/chunk": float(index)}, {}

    settings = AsyncSettings(
        groups_per_step=1,
        n_samples=2,
        max_staleness=1,
        stale_groups="drop",
        chunk_groups=1,
        capacity=2,
        total_steps=2,
        deterministic=False,
        pause_mode=mode,
    )
    batches, metrics = [], []
    with FullyAsyncPipeline(sess, None, generate, settings, start_step=0) as rollouts:  # type: ignore[arg-type]
        for step in range(2):
            sequences, step_metrics = rollouts.next_batch(step)
            if step == 0:
                assert reached.wait(60), "chunk 1 never started"
            step_metrics.update(rollouts.push_weights(torch.nn.Linear(1, 1)))
            batches.append(sequences)
            metrics.append(step_metrics)
    return batches, metrics, engine


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_a_sample_in_flight_spans_the_update_with_policy_versions(mode):
    batches, metrics, engine = run_two_steps(mode)
    assert engine.pause_gate.pauses == 1 and not engine.pause_gate.paused
    assert engine.weight_version == 6  # initial sync + two pushes, two buckets each
    # abort: the cut samples come back, are continued after the update, and are counted
    assert engine.metrics()["rollout/partial_samples"] == (2.0 if mode == "abort" else 0.0)
    # step 0 trains chunk 0, made whole at version 0; step 1 the chunk the update cut
    assert [list(s.versions) for s in batches[0]] == [[0] * NEW_TOKENS] * 2
    split = [0] * OLD + [1] * (NEW_TOKENS - OLD)
    assert [list(s.versions) for s in batches[1]] == [split, split]
    assert [m["weight_sync/paused"] for m in metrics] == [1.0, 0.0]  # the last push finds no chunk in flight
    assert [m["async/partial_samples_frac"] for m in metrics] == [0.0, 1.0]
    assert metrics[1]["async/partial_tokens_frac"] == pytest.approx((NEW_TOKENS - OLD) / NEW_TOKENS)
    assert metrics[1]["staleness/token_mean"] == pytest.approx(OLD / NEW_TOKENS)
    assert metrics[1]["staleness/token_max"] == 1.0 and metrics[1]["staleness/sample_max"] == 1.0
    assert metrics[1]["staleness/tokens_1"] == pytest.approx(OLD / NEW_TOKENS)
    # the step's per-token staleness (the loss's input): trainer version 1 minus each token's version
    micro = build_micro_batches(batches[1], dp_rank=0, dp_size=1, micro_batches=1, pad_id=0)
    TokenStaleness(trainer_version=1).apply(StepBatch([micro]))
    (mb,) = micro
    mask = mb.versions >= 0
    assert int(mask.sum()) == 2 * NEW_TOKENS
    expected = torch.tensor([1.0] * OLD + [0.0] * (NEW_TOKENS - OLD))
    for row in range(2):
        assert torch.equal(mb.staleness[row][mask[row]], expected)
        assert torch.equal(mb.staleness[row][~mask[row]], torch.zeros(int((~mask[row]).sum())))


def test_pause_mode_none_waits_for_whole_samples():
    batches, metrics, engine = run_two_steps("none")
    assert engine.pause_gate.pauses == 0
    assert [list(s.versions) for s in batches[1]] == [[0] * NEW_TOKENS] * 2  # made at version 0, trained at 1
    assert [m["weight_sync/paused"] for m in metrics] == [0.0, 0.0]
    assert [m["async/partial_samples_frac"] for m in metrics] == [0.0, 0.0]
    assert metrics[1]["staleness/token_mean"] == 1.0


def test_a_pause_that_fails_is_the_updates_error():
    """The engine does not pause in time: the weight update raises its error (no hang, no silent wait), and the
    producer is not left blocked behind the update."""
    release, started = threading.Event(), threading.Event()

    class StuckEngine:
        def served_weight_version(self) -> int:
            return 0

        def pause_generation(self, mode: str) -> None:
            raise TimeoutError(f"generation did not pause ({mode}) within 1 s")

    def generate(index: int, groups: int):
        if index == 1:
            started.set()
            assert release.wait(60)
        return [TrainSequence([1, 2], [3, 4], 1.0, [-0.5, -0.5]) for _ in range(2 * groups)], {}, {}

    sess = SimpleNamespace(**{**session(None).__dict__, "rollout": StuckEngine(), "sync": BucketedSync(None)})
    settings = AsyncSettings(1, 2, 1, "drop", 1, 2, 3, False, pause_mode="in_place")
    with FullyAsyncPipeline(sess, None, generate, settings, start_step=0) as rollouts:  # type: ignore[arg-type]
        rollouts.next_batch(0)
        assert started.wait(60)
        with pytest.raises(TimeoutError, match="did not pause"):
            rollouts.push_weights(torch.nn.Linear(1, 1))
        assert sess.sync.pushes == 0  # nothing was pushed into an engine that kept generating
        assert not rollouts._push_pending
        release.set()


def test_a_refill_after_the_update_carries_the_version_that_made_it():
    """A chunk's second generate call (a dynamic-sampling refill) starts after the paused update: its sample is
    whole of policy version 1 and trained at staleness 0, while the chunk's first sample (version 0) is 1 behind –
    the engine reports versions for every sample, not only for those that span the update."""
    torch.manual_seed(0)
    engine = CPUEngine(make_dense_model(0), num_threads=1)
    sess = session(engine)
    sess.sync.push(None)  # engine version 2 serves policy version 0
    first_done = threading.Event()
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=5)

    def one(group: int):
        (sample,) = engine.generate(
            [GenerationRequest(prompt_ids=[3, 17, 5, 42 + group], n=1, sampling=sampling, group_id=0)]
        )[0]
        return TrainSequence(
            sample.prompt_ids, sample.response_ids, 1.0, sample.rollout_logp, versions=sample.token_versions
        )

    def generate(index: int, groups: int):
        first = one(0)
        if index == 1:  # the refill waits until the trainer's update is done and generation continued
            first_done.set()
            wait_for(lambda: engine.weight_version == 4 and not engine.pause_gate.paused, "the update")
        return [first, one(1)], {}, {}

    settings = AsyncSettings(1, 2, 1, "drop", 1, 2, 2, False, pause_mode="in_place")
    batches, metrics = [], []
    with FullyAsyncPipeline(sess, None, generate, settings, start_step=0) as rollouts:  # type: ignore[arg-type]
        for step in range(2):
            sequences, step_metrics = rollouts.next_batch(step)
            if step == 0:
                assert first_done.wait(60), "chunk 1 never started"
            step_metrics.update(rollouts.push_weights(torch.nn.Linear(1, 1)))
            batches.append(sequences)
            metrics.append(step_metrics)
    assert [list(s.versions) for s in batches[0]] == [[0] * NEW_TOKENS] * 2
    assert [list(s.versions) for s in batches[1]] == [[0] * NEW_TOKENS, [1] * NEW_TOKENS]
    assert metrics[0]["weight_sync/paused"] == 1.0
    assert metrics[1]["staleness/token_mean"] == pytest.approx(0.5)  # was 1.0 with the chunk's start version
    assert metrics[1]["staleness/sample_mean"] == pytest.approx(0.5)
    assert metrics[1]["async/partial_samples_frac"] == 0.0  # whole samples, of two versions
