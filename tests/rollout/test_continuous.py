"""Continuous batching in the CPU server (SGLang's scheduler semantics): a request joins the running batch between
two decode steps, leaves it and is answered as soon as its rows are done, and its tokens, log-probs and routes are
those of the request run alone."""

from __future__ import annotations

import argparse
import threading
import time

import httpx
import numpy as np
import pytest

from sapo_megatron.rollout.cpu.batcher import Batcher, ClientGone
from sapo_megatron.rollout.cpu.continuous import ContinuousBatcher
from sapo_megatron.rollout.cpu.decode import RowResult, RowSpec
from sapo_megatron.rollout.cpu.flags import add_serve_arguments
from sapo_megatron.rollout.cpu.server import CPUServer
from sapo_megatron.rollout.types import Sample, SamplingParams
from tests.rollout.conftest import engine_from, load
from tests.rollout.test_pause import agreement, per_version_reference

LONG, SHORT = 64, 4


def row(prompt: list[int], tokens: int, seed: int, routes: bool = True) -> RowSpec:
    return RowSpec(
        prompt_ids=prompt,
        sampling=SamplingParams(max_new_tokens=tokens, temperature=1.0),
        seed=seed,
        return_routed_experts=routes,
        ignore_eos=True,
    )


def long_row() -> RowSpec:
    return row([3, 17, 5, 42, 8, 11, 9], LONG, seed=11)


def short_rows() -> list[RowSpec]:
    return [row([7, 2], SHORT, seed=5), row([7, 2], SHORT + 3, seed=6)]  # one request of two rows


class Forwards:
    """A forward hook that runs ``actions[k]`` in the batcher thread before the engine's k-th forward (0-based)."""

    def __init__(self, engine, actions: dict[int, object]) -> None:
        self.count = 0
        self.actions = actions
        self.handle = engine.model.register_forward_pre_hook(self._hook)

    def _hook(self, *_: object) -> None:
        action = self.actions.get(self.count)
        self.count += 1
        if action is not None:
            action()  # type: ignore[operator]


def alone(moe_dir, rows: list[RowSpec]) -> list[RowResult]:
    engine = engine_from(moe_dir)
    batcher = ContinuousBatcher(engine, engine.max_batch_size)
    try:
        return batcher.submit(rows).result(60)
    finally:
        batcher.stop()


def assert_same(got: RowResult, want: RowResult) -> None:
    assert got.output_ids == want.output_ids
    np.testing.assert_allclose(got.output_logprobs, want.output_logprobs, atol=1e-4)
    assert got.token_versions == want.token_versions
    assert got.routed_experts is not None and want.routed_experts is not None
    assert got.routed_experts.shape == want.routed_experts.shape
    assert (np.sort(got.routed_experts, -1) == np.sort(want.routed_experts, -1)).all()


def test_a_short_request_joins_a_long_one_and_is_answered_first(moe_dir):
    engine = engine_from(moe_dir)
    batcher = ContinuousBatcher(engine, engine.max_batch_size)
    order: list[str] = []
    futures = {}

    def send_short() -> None:  # sent while the long request decodes (before its 6th forward)
        futures["short"] = batcher.submit(short_rows())
        futures["short"].add_done_callback(lambda _: order.append(f"short@{forwards.count}"))

    forwards = Forwards(engine, {5: send_short})
    try:
        futures["long"] = batcher.submit([long_row()])
        futures["long"].add_done_callback(lambda _: order.append(f"long@{forwards.count}"))
        long_result = futures["long"].result(60)[0]
        short_results = futures["short"].result(60)
    finally:
        batcher.stop()
    # The long request's prefill + 63 feeds; the short one joined at the 6th forward with its own prefill and left
    # after 6 feeds (its longer row's 7 tokens), answered then, long before the long one ended.
    assert forwards.count == 1 + (LONG - 1) + 1
    assert order == ["short@13", f"long@{forwards.count}"]
    assert [len(r.output_ids) for r in short_results] == [SHORT, SHORT + 3]
    assert len(long_result.output_ids) == LONG
    assert_same(long_result, alone(moe_dir, [long_row()])[0])
    for got, want in zip(short_results, alone(moe_dir, short_rows())):
        assert_same(got, want)  # routes of the joined rows: from their own prefill and feeds


def test_an_abort_pause_answers_rows_that_joined_at_different_times(moe_dir):
    engine = engine_from(moe_dir)
    batcher = ContinuousBatcher(engine, engine.max_batch_size)
    futures = {}
    paused = threading.Event()

    def pause_abort() -> None:  # the pause lands at the checkpoint after this forward
        threading.Thread(target=lambda: (engine.pause_generation("abort"), paused.set())).start()
        while not engine.pause_gate.paused:
            pass

    short_rows_long = [row([7, 2], LONG, seed=5)]

    def send_long_short() -> None:
        futures["short"] = batcher.submit(short_rows_long)

    Forwards(engine, {4: send_long_short, 10: pause_abort})
    try:
        futures["long"] = batcher.submit([long_row()])
        long_result = futures["long"].result(60)[0]
        short_result = futures["short"].result(60)[0]
        assert paused.wait(10)
        held = batcher.submit([row([4, 4], 3, seed=1)])  # sent during the pause: held, then served
        assert not held.done()
        engine.continue_generation()
        assert [len(r.output_ids) for r in held.result(60)] == [3]
    finally:
        batcher.stop()
    assert long_result.finish_reason == short_result.finish_reason == "abort"
    # forwards 0-4: the long row's prefill and 4 feeds (the second request arrives during the 4th); 5: its prefill;
    # 6-10: 5 feeds of both; then each samples once more and the abort pause answers both
    assert (len(long_result.output_ids), len(short_result.output_ids)) == (10, 6)
    want_long = alone(moe_dir, [long_row()])[0]
    want_short = alone(moe_dir, short_rows_long)[0]
    assert long_result.output_ids == want_long.output_ids[:10]
    assert short_result.output_ids == want_short.output_ids[:6]
    np.testing.assert_allclose(long_result.output_logprobs, want_long.output_logprobs[:10], atol=1e-4)
    np.testing.assert_allclose(short_result.output_logprobs, want_short.output_logprobs[:6], atol=1e-4)


def test_a_failing_forward_in_a_merged_batch_fails_only_its_request(moe_dir):
    engine = engine_from(moe_dir)
    poison = 13

    def fail_on_poison(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and (ids == poison).any():
            raise RuntimeError("poisoned row")

    engine.model.register_forward_pre_hook(fail_on_poison, with_kwargs=True)
    batcher = ContinuousBatcher(engine, engine.max_batch_size)
    futures = {}

    def send_poison() -> None:
        futures["bad"] = batcher.submit([row([poison, 1], 5, seed=2)])

    Forwards(engine, {3: send_poison})
    try:
        futures["long"] = batcher.submit([long_row()])
        long_result = futures["long"].result(60)[0]
        with pytest.raises(RuntimeError, match="poisoned"):
            futures["bad"].result(60)
    finally:
        batcher.stop()
    assert_same(long_result, alone(moe_dir, [long_row()])[0])  # run again alone from its prompt, same seed


def test_server_answers_a_short_request_while_a_long_one_runs(moe_dir):
    """Over HTTP, the server's default batcher: the short request's reply comes while the long one decodes."""
    engine = engine_from(moe_dir)
    engine.model.register_forward_pre_hook(lambda *_: time.sleep(0.01))  # the long request lasts >= 0.64 s
    replies: dict[str, dict] = {}
    with CPUServer(engine) as server:
        sent = threading.Event()

        def post(name: str, prompt: list[int], tokens: int) -> None:
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "sampling_seed": 3},
                "return_logprob": True,
            }
            replies[name] = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
            replies[name]["forwards"] = forwards.count

        forwards = Forwards(engine, {3: sent.set})
        long_thread = threading.Thread(target=post, args=("long", [3, 17, 5], LONG))
        long_thread.start()
        assert sent.wait(30)
        post("short", [7, 2], SHORT)
        long_thread.join(60)
    assert replies["short"]["forwards"] < replies["long"]["forwards"] == LONG + 1  # + the short one's prefill
    assert replies["short"]["meta_info"]["completion_tokens"] == SHORT
    assert replies["long"]["meta_info"]["completion_tokens"] == LONG


def test_static_batches_flag_selects_the_static_batcher(moe_dir):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["--model-path", "m", "--static-batches"]).static_batches is True
    assert parser.parse_args(["--model-path", "m"]).static_batches is False
    engine = engine_from(moe_dir)
    with CPUServer(engine, static_batches=True) as static, CPUServer(engine) as continuous:
        assert type(static.batcher) is Batcher and type(continuous.batcher) is ContinuousBatcher
        body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 5, "sampling_seed": 1}}
        replies = [
            httpx.post(f"{s.url}/generate", json=body, timeout=60).json() for s in (static, continuous)
        ]
    assert replies[0]["output_ids"] == replies[1]["output_ids"] and len(replies[0]["output_ids"]) == 5


def test_a_retract_pause_reprefills_rows_that_joined_at_different_times(moe_dir, moe_dir_b):
    """Both rows continue with the new weights over a recomputed prefix; each token's log-prob and route come from
    the forward of its version (as ``test_pause`` checks for one batch)."""
    engine = engine_from(moe_dir)
    batcher = ContinuousBatcher(engine, engine.max_batch_size)
    futures = {}
    rows = [long_row(), row([7, 2], 20, seed=5)]
    rows[0].sampling = SamplingParams(max_new_tokens=20, temperature=1.0)

    def update() -> None:
        engine.pause_generation("retract")
        engine.update_weights_from_disk(str(moe_dir_b))
        engine.continue_generation()

    def pause_retract() -> None:
        threading.Thread(target=update).start()
        while not engine.pause_gate.paused:
            pass

    def send_second() -> None:
        futures["second"] = batcher.submit([rows[1]])

    Forwards(engine, {3: send_second, 8: pause_retract})
    try:
        first = batcher.submit([rows[0]]).result(60)[0]
        second = futures["second"].result(60)[0]
    finally:
        batcher.stop()
    refs = {0: load(moe_dir), 1: load(moe_dir_b)}
    # before the pause the first row sampled 8 tokens (forwards 0-3 and 5-8), the second 5 (its prefill is forward 4)
    for res, spec, before in ((first, rows[0], 8), (second, rows[1], 5)):
        assert res.token_versions == [0] * before + [1] * (20 - before)
        assert res.recomputed_tokens == len(spec.prompt_ids) + before
        sample = Sample(
            group_id=0,
            sample_index=0,
            prompt_ids=spec.prompt_ids,
            response_ids=res.output_ids,
            rollout_logp=res.output_logprobs,
            finish_reason=res.finish_reason,
            routed_experts=res.routed_experts,
            token_versions=res.token_versions,
        )
        want_logp, want_routes = per_version_reference(refs, sample)
        np.testing.assert_allclose(res.output_logprobs, want_logp, atol=1e-4)
        assert agreement(sample, want_routes) == 1.0


def test_a_running_request_whose_client_hung_up_is_dropped(moe_dir):
    engine = engine_from(moe_dir)
    batcher = ContinuousBatcher(engine, engine.max_batch_size)
    hung_up = threading.Event()
    forwards = Forwards(engine, {10: hung_up.set})
    try:
        order: list[str] = []
        gone = batcher.submit([long_row()], client_gone=hung_up.is_set)
        gone.add_done_callback(lambda _: order.append("gone"))
        other = batcher.submit([row([7, 2], 40, seed=5)])
        other.add_done_callback(lambda _: order.append("other"))
        with pytest.raises(ClientGone):
            gone.result(60)
        assert len(other.result(60)[0].output_ids) == 40
        assert order == ["gone", "other"]  # dropped while the other request still ran
    finally:
        batcher.stop()
    # the long request left the batch at the first check after the hang-up: its 64 tokens were never all made
    assert forwards.count < LONG and batcher.dropped == 1


def test_stopping_fails_running_and_queued_requests(moe_dir):
    engine = engine_from(moe_dir)
    batcher = ContinuousBatcher(engine, 1)  # one running row: the second request waits in the queue
    stop = threading.Thread(target=batcher.stop)
    Forwards(engine, {5: stop.start})
    running = batcher.submit([long_row()])
    queued = batcher.submit([row([7, 2], 4, seed=5)])
    for future in (running, queued):
        with pytest.raises(RuntimeError, match="server stopped"):
            future.result(30)
    stop.join(30)
    assert not stop.is_alive() and batcher.pending == 0
