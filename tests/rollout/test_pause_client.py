"""SGLangClient.pause_generation / continue_generation over CPU servers: partial rollouts continued across a weight
update with per-token versions, and one clear error (naming the server) when a server dies or a call times out."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from sapo_megatron.rollout.cpu.server import CPUServer
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.sglang.errors import Unavailable
from tests.rollout.conftest import NUM_LAYERS, TOP_K, engine_from, load
from tests.rollout.test_pause import PROMPT, agreement, per_version_reference

NEW = 40


@pytest.fixture(scope="module")
def refs(moe_dir, moe_dir_b):
    return {0: load(moe_dir), 1: load(moe_dir_b)}


def slow_server(model_dir, delay_s: float = 0.02) -> CPUServer:
    engine = engine_from(model_dir)
    engine.model.register_forward_pre_hook(lambda *_: time.sleep(delay_s))
    return CPUServer(engine).start()


def _request(n: int, routed: bool = True, new: int = NEW):
    from sapo_megatron.rollout.types import GenerationRequest, SamplingParams

    sampling = SamplingParams(max_new_tokens=new, temperature=1.0, seed=11)
    return GenerationRequest(
        prompt_ids=PROMPT, n=n, sampling=sampling, return_routed_experts=routed, group_id=0
    )


def _wait_until_submitted(servers: list[CPUServer], requests: int, timeout_s: float = 60.0) -> None:
    """Until the servers' batchers hold ``requests`` requests (queued or running): a sleep alone let the pause come
    before a slow machine's HTTP request reached its server."""
    deadline = time.monotonic() + timeout_s
    while sum(server.batcher.pending for server in servers) < requests:
        assert time.monotonic() < deadline, "the requests never reached the servers"
        time.sleep(0.01)


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_client_continues_samples_across_a_paused_weight_update(mode, moe_dir, moe_dir_b, refs):
    servers = [slow_server(moe_dir), slow_server(moe_dir)]
    client = SGLangClient([s.url for s in servers], num_layers=NUM_LAYERS, top_k=TOP_K, max_retries=0)
    try:
        out: dict = {}
        worker = threading.Thread(target=lambda: out.update(groups=client.generate([_request(4)])))
        worker.start()
        _wait_until_submitted(servers, 4)  # a request the pause came before would be made whole by version 1
        time.sleep(0.3)
        client.pause_generation(mode)
        client.update_weights_from_disk(str(moe_dir_b))
        client.continue_generation()
        worker.join(timeout=120)
        samples = out["groups"][0]
        assert len(samples) == 4
        # A request still queued at the pause is made whole by version 1: the server reports [1] * NEW for it,
        # and its log-probs must then be version 1's.
        for s in samples:
            assert len(s.response_ids) == NEW and s.finish_reason == "length"
            k = s.token_versions.count(0)
            assert k < NEW and s.token_versions == [0] * k + [1] * (NEW - k)
            want_logp, want_routes = per_version_reference(refs, s)
            np.testing.assert_allclose(s.rollout_logp, want_logp, atol=1e-4)
            assert agreement(s, want_routes) == 1.0
        assert any(s.token_versions.count(0) > 0 for s in samples)  # paused mid-response
        metrics = client.metrics()
        assert metrics["rollout/partial_samples"] == (4 if mode == "abort" else 0)
        assert metrics["rollout/aborted_samples"] == 0
    finally:
        client.close()
        for s in servers:
            s.stop()


def test_a_server_that_dies_mid_pause_fails_continue_naming_it(moe_dir):
    servers = [slow_server(moe_dir), slow_server(moe_dir)]
    client = SGLangClient([s.url for s in servers], max_retries=0)
    try:
        client.pause_generation("retract", timeout_s=5)
        servers[1].stop()
        started = time.monotonic()
        with pytest.raises(Unavailable) as err:
            client.continue_generation(timeout_s=5)
        assert time.monotonic() - started < 5
        message = str(err.value)
        assert "continue_generation" in message and servers[1].url in message and "\n" not in message
        assert not client.fleet.pause.paused  # the live server did continue
    finally:
        client.close()
        for s in servers:
            s.stop()


@pytest.mark.slow
def test_a_pause_that_times_out_names_the_server(moe_dir):
    server = slow_server(moe_dir, delay_s=3.0)  # one forward outlasts the pause timeout
    client = SGLangClient([server.url], max_retries=0)
    try:
        worker = threading.Thread(target=lambda: _quiet(client.generate, [_request(1, routed=False, new=2)]))
        worker.start()
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(Unavailable) as err:
            client.pause_generation("in_place", timeout_s=0.5)
        assert time.monotonic() - started < 2.5
        assert "pause_generation(in_place)" in str(err.value) and server.url in str(err.value)
        client.continue_generation(timeout_s=10)
    finally:
        server.stop()
        client.close()


def _quiet(fn, *args):
    with contextlib.suppress(Exception):  # the server stops under it at the end of the test
        fn(*args)


def test_pause_refuses_an_unknown_mode_before_sending(moe_dir):
    client = SGLangClient(["http://127.0.0.1:9"], max_retries=0)
    with pytest.raises(ValueError, match="mode 'freeze' is not one of"):
        client.pause_generation("freeze")
    assert not client.fleet.pause.paused


def test_the_default_pause_is_in_place_and_skips_the_flush_while_held(moe_dir, moe_dir_b):
    server = slow_server(moe_dir)
    client = SGLangClient([server.url], max_retries=0)
    try:
        client.pause_generation()
        assert server.engine.pause_gate.mode == "in_place" and client.fleet.pause.mode == "in_place"
        client.update_weights_from_disk(
            str(moe_dir_b)
        )  # flush_cache=True is skipped: held requests refuse it
        assert server.engine.weight_version == 1 and server.weights.weight_version == "1"
        client.continue_generation()
        assert server.engine.pause_gate.mode is None and not client.fleet.pause.paused
    finally:
        client.close()
        server.stop()


def test_every_sample_carries_its_version_and_foreign_labels_none(moe_dir, moe_dir_b, refs):
    """Whole samples report their version too (one span of ``meta_info.weight_versions``), so a sample generated
    after an update is tagged with it; a label this client did not set (another client's update) gives no
    versions and is counted."""
    server = CPUServer(engine_from(moe_dir)).start()
    client = SGLangClient([server.url], num_layers=NUM_LAYERS, top_k=TOP_K, max_retries=0)
    other = SGLangClient([server.url], max_retries=0)
    try:
        (before,) = client.generate([_request(1, new=6)])[0]
        assert before.token_versions == [0] * 6
        client.update_weights_from_disk(str(moe_dir_b))
        (after,) = client.generate([_request(1, new=6)])[0]
        assert after.token_versions == [1] * 6
        want_logp, want_routes = per_version_reference(refs, after)
        np.testing.assert_allclose(after.rollout_logp, want_logp, atol=1e-4)
        assert agreement(after, want_routes) == 1.0
        (foreign,) = other.generate([_request(1, routed=False, new=6)])[0]  # label "1", this client counts 0
        assert foreign.token_versions is None
        assert other.metrics()["rollout/partial_unsplit"] == 1
        assert client.metrics()["rollout/partial_unsplit"] == 0
    finally:
        client.close()
        other.close()
        server.stop()


def test_an_abort_reply_that_arrives_after_continue_is_continued_not_restarted(moe_dir, moe_dir_b, refs):
    """The abort pause's reply may reach the client only after ``continue_generation`` (a loaded machine): the
    sample was cut by this client's pause (a newer pause epoch), so it is continued from its partial, not retried
    from scratch on the new weights."""
    server = slow_server(moe_dir)
    client = SGLangClient([server.url], num_layers=NUM_LAYERS, top_k=TOP_K, max_retries=1, backoff_s=0.0)
    send = client.fleet.request
    late = threading.Event()

    def request(method, srv, path, payload, **kwargs):
        reply = send(method, srv, path, payload, **kwargs)
        if path == "/generate" and reply["meta_info"]["finish_reason"]["type"] == "abort":
            assert late.wait(60)  # held until continue_generation has returned
        return reply

    client.fleet.request = request  # type: ignore[method-assign]
    try:
        out: dict = {}
        worker = threading.Thread(target=lambda: out.update(groups=client.generate([_request(1)])))
        worker.start()
        _wait_until_submitted([server], 1)
        time.sleep(0.3)
        client.pause_generation("abort")
        client.update_weights_from_disk(str(moe_dir_b))
        client.continue_generation()
        late.set()
        worker.join(timeout=120)
        (s,) = out["groups"][0]
        k = s.token_versions.count(0)
        assert 0 < k < NEW and s.token_versions == [0] * k + [1] * (NEW - k)  # a restart would be all 1
        want_logp, want_routes = per_version_reference(refs, s)
        np.testing.assert_allclose(s.rollout_logp, want_logp, atol=1e-4)
        assert agreement(s, want_routes) == 1.0
        assert client.metrics()["rollout/partial_samples"] == 1
    finally:
        late.set()
        client.close()
        server.stop()
