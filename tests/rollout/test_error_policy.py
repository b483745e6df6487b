"""The SGLang client's one error policy (rollout/sglang/errors.py, fleet.py), as a table: each kind of failure of
one worker, and what it leads to in each kind of call.

Two workers behind an in-memory HTTP transport (``httpx.MockTransport``): worker A fails in the way of the row,
worker B answers as SGLang does. ``max_concurrency=1`` makes the first request go to A (round-robin from A).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from sapo_megatron.rollout.base import RolloutError
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.sglang.errors import (
    MalformedReply,
    OnTransient,
    Overloaded,
    Refused,
    TransientError,
    Unavailable,
    Unreachable,
    on_error,
)
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams

A, B = "http://worker-a:30000", "http://worker-b:30000"


def _raise(exc_type: type[Exception]):
    def fail(request: httpx.Request) -> httpx.Response:
        raise exc_type(f"{exc_type.__name__} (simulated)", request=request)

    return fail


FAILURES = {
    "connection refused": _raise(httpx.ConnectError),
    "connection reset": _raise(httpx.RemoteProtocolError),
    "read timeout": _raise(httpx.ReadTimeout),
    "connect timeout": _raise(httpx.ConnectTimeout),
    "HTTP 429": lambda _: httpx.Response(429, json={"error": {"message": "too many requests"}}),
    "HTTP 500": lambda _: httpx.Response(500, text="Internal Server Error"),
    "HTTP 503": lambda _: httpx.Response(503, json={"error": {"message": "overloaded"}}),
    "HTTP 400": lambda _: httpx.Response(400, json={"error": {"message": "prompt is too long"}}),
    "HTTP 401": lambda _: httpx.Response(401, json={"error": "Unauthorized"}),
    "HTTP 404": lambda _: httpx.Response(404, json={"detail": "Not Found"}),
    "malformed reply": lambda _: httpx.Response(200, content=b'{"text": "unterminated'),
    "success false": lambda _: httpx.Response(200, json={"success": False, "message": "no such file"}),
}

FAIL_OVER, SKIP, COOL_DOWN, OK = "fail over", "skip", "cool down", "ok"
# failure -> (typed error of Fleet.request, generate, a weight update, weight checksums, a cache flush):
# a transient error fails over / leaves the worker out / raises Unavailable / cools it down; any other is raised
# (an error class) at once, never retried. A flush reads no JSON and no "success".
POLICY = {
    "connection refused": (Unreachable, FAIL_OVER, SKIP, Unavailable, COOL_DOWN),
    "connection reset": (Unreachable, FAIL_OVER, SKIP, Unavailable, COOL_DOWN),
    "read timeout": (Unreachable, FAIL_OVER, SKIP, Unavailable, COOL_DOWN),
    "connect timeout": (Unreachable, FAIL_OVER, SKIP, Unavailable, COOL_DOWN),
    "HTTP 429": (Overloaded, FAIL_OVER, SKIP, Unavailable, COOL_DOWN),
    "HTTP 500": (Overloaded, FAIL_OVER, SKIP, Unavailable, COOL_DOWN),
    "HTTP 503": (Overloaded, FAIL_OVER, SKIP, Unavailable, COOL_DOWN),
    "HTTP 400": (Refused, Refused, Refused, Refused, Refused),
    "HTTP 401": (Refused, Refused, Refused, Refused, Refused),
    "HTTP 404": (Refused, Refused, Refused, Refused, Refused),
    "malformed reply": (MalformedReply, MalformedReply, MalformedReply, MalformedReply, OK),
    "success false": (None, RolloutError, Refused, Refused, OK),
}


def healthy(request: httpx.Request) -> httpx.Response:
    """Worker B: SGLang's replies to the calls of these tests."""
    path = request.url.path
    if path == "/generate":
        body = json.loads(request.content)
        return httpx.Response(
            200,
            json={
                "text": "",
                "output_ids": [5],
                "meta_info": {
                    "id": body["rid"],
                    "finish_reason": {"type": "length", "length": 1},
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": 1,
                    "output_token_logprobs": [[-0.5, 5, None]],
                },
            },
        )
    if path == "/flush_cache":
        return httpx.Response(200, text="Cache flushed.\n")
    if path == "/weights_checker":
        return httpx.Response(200, json={"success": True, "ranks": [{"checksums": {"w": "ab12"}}]})
    return httpx.Response(200, json={"success": True, "message": "ok"})


@pytest.fixture
def cluster():
    """A client of workers A and B; ``failure``: how A answers; ``calls``: (worker, path) of every request."""
    state = {"failure": healthy, "calls": []}

    def handler(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        state["calls"].append((url, request.url.path))
        return state["failure"](request) if url == A else healthy(request)

    client = SGLangClient([A, B], max_concurrency=1, max_retries=2, backoff_s=0.001, max_backoff_s=0.001)
    client.fleet.http.close()
    client.fleet.http = httpx.Client(transport=httpx.MockTransport(handler))
    with client:
        yield client, state


def one_sample() -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt_ids=[1, 2, 3], n=1, sampling=SamplingParams(max_new_tokens=2), group_id=7)
    ]


def calls_to(state, worker: str, path: str) -> int:
    return sum(1 for url, p in state["calls"] if url == worker and p == path)


@pytest.mark.parametrize("failure", list(FAILURES))
def test_each_failure_maps_to_one_typed_error_and_one_action_per_call(cluster, failure):
    client, state = cluster
    typed, generate, update, checksums, flush = POLICY[failure]
    state["failure"] = FAILURES[failure]
    server = client.fleet.servers[0]

    # Fleet.request: the typed error; on_error: transient errors follow the call's policy, others are raised
    if typed is not None:
        with pytest.raises(typed) as caught:
            client.fleet.request("POST", server, "/update_weights_from_disk", {}, request="probe")
        assert caught.value.server == A and caught.value.request == "probe"
        transient = issubclass(typed, TransientError)
        for policy in OnTransient:
            assert on_error(caught.value, policy) is (policy if transient else OnTransient.RAISE)

    # generate: fail over to B (one retry, one failover), or raise the error at once (A asked once, B never)
    state["calls"].clear()
    if generate == FAIL_OVER:
        [[sample]] = client.generate(one_sample())
        assert sample.response_ids == [5] and sample.rollout_logp == [-0.5]
        metrics = client.metrics()
        assert (
            metrics["rollout/transient_errors"]
            == metrics["rollout/retries"]
            == metrics["rollout/failovers"]
            == 1
        )
        assert calls_to(state, A, "/generate") == calls_to(state, B, "/generate") == 1
    else:
        with pytest.raises(generate) as caught:
            client.generate(one_sample())
        assert caught.value.server == A and not isinstance(caught.value, TransientError)
        assert calls_to(state, A, "/generate") == 1 and calls_to(state, B, "/generate") == 0

    # a weight update: A is left out (stale, the router bypassed) or the update fails
    state["calls"].clear()
    if update == SKIP:
        client.update_weights_from_disk("/ckpt/v1")
        assert client.metrics()["rollout/stale_servers"] == 1
        assert calls_to(state, B, "/flush_cache") == 1 and calls_to(state, A, "/flush_cache") == 0
        assert [s.url for s in client.fleet.current_workers()] == [B]
        return  # A holds old weights from here on: the calls below would not reach it
    with pytest.raises(update) as caught:
        client.update_weights_from_disk("/ckpt/v1")
    assert caught.value.server == A and calls_to(state, A, "/update_weights_from_disk") == 1

    # weight checksums need every worker
    with pytest.raises(checksums) as caught:
        client.weight_checksums()
    assert caught.value.server == A

    # a cache flush cools an unreachable worker down and goes on
    if flush == OK:
        client.flush_cache()
    else:
        with pytest.raises(flush):
            client.flush_cache()
    assert calls_to(state, B, "/flush_cache") == 1


@pytest.mark.parametrize("failure", [f for f, row in POLICY.items() if row[0] in (Unreachable, Overloaded)])
def test_transient_failures_of_calls_that_need_every_worker(cluster, failure):
    client, state = cluster
    state["failure"] = FAILURES[failure]
    with pytest.raises(Unavailable, match="weights_checker: unreachable") as caught:
        client.weight_checksums()
    assert caught.value.server == A and caught.value.field == "transport"
    before = time.monotonic()
    client.flush_cache()  # A cooled down: generation skips it while B is ready
    assert client.fleet.servers[0].cooldown_until > before
    assert [client.fleet.pick_server(avoid=None).url for _ in range(4)] == [B] * 4


def test_a_worker_down_everywhere_is_unavailable_naming_the_request(cluster):
    client, state = cluster
    state["failure"] = FAILURES["HTTP 503"]
    client.fleet.servers.pop()  # A alone
    with pytest.raises(Unavailable) as caught:
        client.generate(one_sample())
    message = str(caught.value)
    assert "failed on 3 attempts, last error: HTTP 503 from /generate" in message and "-g7-s0" in message
    assert calls_to(state, A, "/generate") == 3
    with pytest.raises(Unavailable, match=r"update_weights_from_disk.*no worker was reachable: HTTP 503"):
        client.update_weights_from_disk("/ckpt/v1")


def test_update_sessions_follow_the_same_policy(cluster):
    """``/begin_weight_update``: 404 means no sessions (older SGLang, the CPU server); a 5xx is transient like any
    other call (the worker is left out of the update); a 4xx is raised."""
    client, state = cluster

    def sessions(status: int):
        def answer(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/begin_weight_update":
                return httpx.Response(status, json={"detail": "x"})
            return healthy(request)

        return answer

    state["failure"] = sessions(404)
    client.update_weights_from_tensors([])
    client.finish_weight_update()
    assert client.metrics()["rollout/stale_servers"] == 0

    state["failure"] = sessions(503)
    client.update_weights_from_tensors([])
    client.finish_weight_update()
    assert (
        client.metrics()["rollout/stale_servers"] == 1
        and calls_to(state, A, "/update_weights_from_tensor") == 1
    )

    client.fleet.servers[0].weight_version = client.fleet.weight_version  # as if A had caught up
    state["failure"] = sessions(401)
    with pytest.raises(Refused, match="HTTP 401 from /begin_weight_update"):
        client.update_weights_from_tensors([])
