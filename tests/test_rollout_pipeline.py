"""The rollout pipeline on its own (a fake engine and weight sync): what each step trains on, which weights
generated it, that the next batch is generated while the caller trains and never while weights are pushed, that a
background failure reaches the loop with its message (on every rank of a 2-process group), and the checkpointed
batch in flight."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from sapo_megatron.data.prompts import PromptIterator, PromptRow
from sapo_megatron.loop.pipeline import (
    IN_FLIGHT_FILE,
    Rollout,
    RolloutPipeline,
    RolloutResumeError,
    rollout_from_file,
    rollout_to_bytes,
)
from sapo_megatron.model.batching import TrainSequence
from sapo_megatron.rewards.registry import RewardError
from sapo_megatron.runtime.ranks import MainRankFailed

ROWS = [PromptRow(prompt=f"{i}+1=", ground_truth=str(i + 1)) for i in range(20)]


class FakeEngine:
    """Generation and weight pushes that record what they saw: the weight version each generation sampled
    from, and whether a push ever arrived while a generation was running."""

    def __init__(self, *, block: bool = False) -> None:
        self.version = 0
        self.generating = False
        self.pushed_while_generating = False
        self.sampled_from: dict[int, int] = {}
        self.threads: dict[int, str] = {}
        self.block = block
        self.released = threading.Event()
        self.fail_at: int | None = None

    def generate(self, prompts: PromptIterator, step: int):
        self.generating = True
        try:
            rows = next(prompts)
            self.sampled_from[step] = self.version
            self.threads[step] = threading.current_thread().name
            if self.block and step > 0:  # the caller must be able to go on (train) while this waits
                assert self.released.wait(timeout=10), "the generation blocked the caller"
            if step == self.fail_at:
                raise RewardError(f"reward raised on 8 of 8 samples at step {step}", hint="fix the reward")
            sequences = [TrainSequence([1, 2], [3], 0.5, [-0.25], sample_id=r.prompt) for r in rows]
            return sequences, {"reward/mean": float(step)}, prompts.state_dict()
        finally:
            self.generating = False

    def push(self, module) -> dict[str, float]:
        self.pushed_while_generating |= self.generating
        self.version += 1
        return {"weight_sync/version": float(self.version)}


def make_pipeline(engine: FakeEngine, *, overlap: bool, steps: int = 4, checkpointer=None, is_main=True):
    prompts = PromptIterator(ROWS, batch_size=2, seed=0)
    session = SimpleNamespace(
        info=SimpleNamespace(is_main=is_main),
        start=SimpleNamespace(resume=False, checkpoint=None),
        checkpointer=checkpointer,
        sync=SimpleNamespace(push=engine.push),
        cfg=SimpleNamespace(rollout=SimpleNamespace(timeout_s=5.0)),
    )
    pipeline = RolloutPipeline(
        session,
        prompts,
        lambda step: engine.generate(prompts, step),
        start_step=0,
        total_steps=steps,
        overlap=overlap,
    )
    return pipeline, prompts


def run_steps(pipeline: RolloutPipeline, engine: FakeEngine, steps: int) -> list[dict]:
    seen = []
    for step in range(steps):
        sequences, metrics = pipeline.next_batch(step)
        engine.released.set()  # "training": the batch in flight may finish now
        seen.append({"prompts": [s.sample_id for s in sequences], **metrics})
        pipeline.push_weights(module=None)
        engine.released.clear()
    return seen


def test_sync_generates_each_batch_on_the_current_weights():
    engine = FakeEngine()
    pipeline, _ = make_pipeline(engine, overlap=False)
    seen = run_steps(pipeline, engine, 4)
    assert engine.sampled_from == {0: 0, 1: 1, 2: 2, 3: 3}
    assert [m["rollout/staleness"] for m in seen] == [0.0] * 4
    assert set(engine.threads.values()) == {threading.current_thread().name}


def test_async_generates_the_next_batch_in_the_background_on_the_previous_weights():
    engine = FakeEngine(block=True)
    pipeline, prompts = make_pipeline(engine, overlap=True)
    seen = run_steps(pipeline, engine, 4)
    # batch n >= 1 sampled by the weights step n-1 started from; trained after one more push: one step stale
    assert engine.sampled_from == {0: 0, 1: 0, 2: 1, 3: 2}
    assert [m["rollout/staleness"] for m in seen] == [0.0, 1.0, 1.0, 1.0]
    assert [m["reward/mean"] for m in seen] == [0.0, 1.0, 2.0, 3.0]  # each batch trained once, in order
    assert engine.threads[0] == threading.current_thread().name
    assert {engine.threads[s] for s in (1, 2, 3)} == {"rollout-in-flight"}
    assert not engine.pushed_while_generating
    # the prompts of the four batches, in the iterator's order, none skipped or repeated
    order = PromptIterator(ROWS, batch_size=2, seed=0)
    assert [m["prompts"] for m in seen] == [[r.prompt for r in next(order)] for _ in range(4)]
    assert prompts.state_dict() == order.state_dict()  # no generation started past the last step


def test_a_background_failure_is_raised_in_the_loop_with_its_message():
    engine = FakeEngine()
    engine.fail_at = 2
    pipeline, _ = make_pipeline(engine, overlap=True)
    pipeline.next_batch(0)
    pipeline.push_weights(module=None)
    pipeline.next_batch(1)  # starts the generation for step 2, which fails in the background
    with pytest.raises(RewardError, match="reward raised on 8 of 8 samples at step 2") as caught:
        pipeline.push_weights(module=None)
    assert caught.value.hint == "fix the reward"
    assert engine.version == 1  # the step's weights were not pushed after the failure


def test_leaving_on_an_error_waits_for_the_batch_in_flight_and_logs_its_failure(caplog):
    engine = FakeEngine()
    engine.fail_at = 1
    pipeline, _ = make_pipeline(engine, overlap=True)
    with pytest.raises(RuntimeError, match="training failed"), pipeline:
        pipeline.next_batch(0)
        raise RuntimeError("training failed")
    assert "the rollout in flight failed too: RewardError: reward raised on 8 of 8 samples" in caplog.text


def test_a_checkpoint_holds_the_batch_in_flight(tmp_path):
    engine = FakeEngine()
    checkpointer = SimpleNamespace(attachments={})
    pipeline, _ = make_pipeline(engine, overlap=True, checkpointer=checkpointer)
    make = checkpointer.attachments[IN_FLIGHT_FILE]
    pipeline.next_batch(0)
    pipeline.push_weights(module=None)
    data = make()  # after step 0: the batch for step 1, complete
    assert data is not None
    (tmp_path / IN_FLIGHT_FILE).write_bytes(data)
    restored = rollout_from_file(tmp_path / IN_FLIGHT_FILE, step=1)
    assert restored.step == 1 and restored.policy_version == 0
    assert restored.metrics == {"reward/mean": 1.0}
    with pipeline:
        pipeline.next_batch(1)
        pipeline.push_weights(module=None)
        pipeline.next_batch(2)
        pipeline.push_weights(module=None)
        pipeline.next_batch(3)  # the last step: nothing in flight afterwards
        pipeline.push_weights(module=None)
        assert make() is None
    assert IN_FLIGHT_FILE not in checkpointer.attachments


def test_the_saved_batch_round_trips_exactly_and_belongs_to_one_step(tmp_path):
    routes = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)
    logp = [-0.1234567890123456789, -2.5e-17]
    rollout = Rollout(
        step=7,
        sequences=[
            TrainSequence(
                [5, 6],
                [7, 8],
                -1.0 / 3.0,
                logp,
                routed_experts=routes,
                sample_id="g0 s0",
                teacher_logp=[-0.75, -1.0 / 7.0],
                domain_id=3,
                token_values={"noise": [0.5, -1.0 / 9.0]},
            ),
            TrainSequence([5], [9], 0.25, [-1.5], sample_id="g0 s1"),  # no routes, not scored by a teacher
        ],
        metrics={"reward/mean": 0.1},
        prompt_state={"epoch": 1, "position": 4, "fingerprint": "ab"},
        policy_version=6,
    )
    path = tmp_path / IN_FLIGHT_FILE
    path.write_bytes(rollout_to_bytes(rollout))
    back = rollout_from_file(path, step=7)
    assert back.sequences == rollout.sequences  # every field: ids, advantage, log-probs bit for bit (float64)
    seq = back.sequences[0]
    assert seq.routed_experts.dtype == np.int32 and np.array_equal(seq.routed_experts, routes)
    assert seq.token_values == {"noise": [0.5, -1.0 / 9.0]}  # not part of ==: checked on its own
    assert back.sequences[1].routed_experts is None and back.sequences[1].teacher_logp is None
    assert (back.prompt_state, back.policy_version, back.metrics) == (
        rollout.prompt_state,
        6,
        {"reward/mean": 0.1},
    )
    with pytest.raises(RolloutResumeError, match=r"batch in flight for RL step 7 .* resumes at step 8"):
        rollout_from_file(path, step=8)


def two_ranks(payload: None) -> dict:
    """One rank of a 2-process gloo group, twice: a clean run of 4 steps, then one whose rollout for step 2 fails
    in rank 0's background thread. Only rank 0 generates."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    is_main = dist.get_rank() == 0
    result = {}
    for name, fail_at in (("clean", None), ("failing", 2)):
        engine = FakeEngine()
        engine.fail_at = fail_at
        pipeline, prompts = make_pipeline(engine, overlap=True, is_main=is_main)
        seen, error = [], None
        try:
            for step in range(4):
                sequences, metrics = pipeline.next_batch(step)
                seen.append(([s.sample_id for s in sequences], metrics["rollout/staleness"]))
                pipeline.push_weights(module=None)
        except (RewardError, MainRankFailed) as exc:
            error = f"{type(exc).__name__}: {exc}"
        result[name] = {
            "seen": seen,
            "prompts": prompts.state_dict(),
            "generated": sorted(engine.sampled_from),
        }
        result[name]["error"] = error
    return result


def test_only_the_main_rank_generates_and_a_failure_there_reaches_every_rank():
    from tests.distributed import run_distributed

    main, other = run_distributed("tests.test_rollout_pipeline:two_ranks", 2)
    clean = main["clean"], other["clean"]
    assert clean[0]["generated"] == [0, 1, 2, 3] and clean[1]["generated"] == []
    assert clean[0]["seen"] == clean[1]["seen"]  # the same batches on both ranks
    assert [stale for _, stale in clean[0]["seen"]] == [0.0, 1.0, 1.0, 1.0]
    assert clean[0]["prompts"] == clean[1]["prompts"] and clean[0]["error"] is None is clean[1]["error"]
    failing = main["failing"], other["failing"]
    message = "RewardError: reward raised on 8 of 8 samples at step 2"
    assert (
        failing[0]["error"] == message and failing[1]["error"] == f"MainRankFailed: rank 0 failed: {message}"
    )
    assert [len(r["seen"]) for r in failing] == [2, 2]  # both ranks stopped at the end of the same step
