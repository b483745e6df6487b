"""The CPU server under hostile or broken HTTP clients (issue 20, Why 2, 3 and 5's HTTP cases), loopback only."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from sapo_megatron.rollout.cpu.batcher import Batcher, ClientGone
from sapo_megatron.rollout.cpu.engine import RowSpec
from sapo_megatron.rollout.cpu.http import Limits, Request
from sapo_megatron.rollout.cpu.pause import PauseGate
from sapo_megatron.rollout.cpu.server import CPUServer, warn_if_exposed
from sapo_megatron.rollout.types import SamplingParams
from tests.rollout.conftest import engine_from

API_KEY = "k3y"
MAX_BODY = 1 << 20
MAX_CONNECTIONS = 8
MAX_ROWS = 16


@pytest.fixture(scope="module")
def servers(moe_dir):
    limits = Limits(max_body_bytes=MAX_BODY, max_connections=MAX_CONNECTIONS)
    open_ = CPUServer(engine_from(moe_dir, seed=0), limits=limits, max_rows_per_request=MAX_ROWS).start()
    keyed = CPUServer(engine_from(moe_dir, seed=0), api_key=API_KEY, limits=limits).start()
    yield open_, keyed
    open_.stop()
    keyed.stop()


def raw_exchange(url: str, head: str, timeout: float = 5.0) -> tuple[bytes, float]:
    """Send only ``head`` (request line and headers, no body) and read what comes back; (reply, seconds)."""
    host, port = url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks), time.monotonic() - started


def test_auth_and_size_are_answered_from_the_headers_at_once(servers):
    open_, keyed = servers
    huge = (
        "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n"
    )
    # Without the key: 401 before reading the (never sent) 10^12 or 20 MB body; the connection is closed.
    for length in (10**12, 20 << 20):
        reply, seconds = raw_exchange(keyed.url, huge.format(length))
        assert reply.startswith(b"HTTP/1.1 401") and b"Connection: close" in reply and seconds < 2.0
    # With the key, or without one: 413 at once, naming the limit and the flag.
    authed = huge.replace("Host: x", f"Host: x\r\nAuthorization: Bearer {API_KEY}")
    for server, head in ((keyed, authed), (open_, huge)):
        reply, seconds = raw_exchange(server.url, head.format(10**12))
        assert reply.startswith(b"HTTP/1.1 413") and b"--max-body-bytes" in reply and seconds < 2.0
    chunked = (
        "POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + (f"{MAX_BODY:x}\r\n" + "a" * MAX_BODY + "\r\n") * 2
    )
    reply, _ = raw_exchange(open_.url, chunked)
    assert reply.startswith(b"HTTP/1.1 413")
    # The servers still serve.
    assert httpx.post(open_.url + "/generate", json={"input_ids": [1, 2]}, timeout=30).status_code == 200


def test_stalled_connections_are_bounded_and_the_rest_get_503(servers):
    open_, _ = servers
    threads_before = threading.active_count()
    host, port = open_.url.removeprefix("http://").split(":")
    stalled = []
    try:
        for _ in range(MAX_CONNECTIONS + 12):  # each sends nothing, like a slowloris client
            stalled.append(socket.create_connection((host, int(port)), timeout=5))
            time.sleep(0.01)  # accepted in order
        time.sleep(0.5)
        assert threading.active_count() - threads_before <= MAX_CONNECTIONS  # not one thread per connection
        busy = [sock.recv(4096).startswith(b"HTTP/1.1 503") for sock in stalled[MAX_CONNECTIONS:]]
        assert busy == [True] * 12
        for sock in stalled[:MAX_CONNECTIONS]:  # held, unanswered, until they send a request
            sock.settimeout(0.05)
            with pytest.raises(TimeoutError):
                sock.recv(4096)
    finally:
        for sock in stalled:
            sock.close()
    time.sleep(0.3)  # slots freed once the stalled clients left
    assert httpx.get(open_.url + "/health", timeout=10).status_code == 200


BAD_FIELDS = [
    ({"sampling_params": {"sampling_seed": 2**70}}, "sampling_seed must be in [0, 2^63 - 1]"),
    ({"sampling_params": {"sampling_seed": -1}}, "sampling_seed must be in"),
    ({"sampling_params": {"sampling_seed": "abc"}}, "sampling_seed must be an integer"),
    ({"logprob_start_len": "abc", "return_logprob": True}, "logprob_start_len must be an integer"),
    ({"sampling_params": {"max_new_tokens": 1e400}}, "max_new_tokens must be an integer"),
    ({"sampling_params": {"max_new_tokens": 250}}, "exceeds the model's maximum context length 256"),
    ({"sampling_params": {"temperature": float("inf")}}, "temperature must be a finite number"),
    ({"sampling_params": {"temperature": float("nan")}}, "temperature must be a finite number"),
    ({"sampling_params": {"top_p": "x"}}, "top_p must be a finite number"),
    ({"return_routed_experts": "yes"}, "return_routed_experts must be true or false"),
    ({"return_logprob": "no"}, "return_logprob must be true or false"),
    ({"sampling_params": {"stop_token_ids": "7"}}, "stop_token_ids must be a list"),
    ({"input_ids": [[1, 2]] * (MAX_ROWS + 1)}, f"at most {MAX_ROWS} per request (--max-rows-per-request)"),
]


def test_bad_fields_get_400_naming_the_field(servers):
    open_, _ = servers
    with httpx.Client(base_url=open_.url, timeout=30) as http:
        for extra, words in BAD_FIELDS:
            payload = {"input_ids": [1, 2, 3, 4, 5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
            payload = {
                **payload,
                **extra,
                "sampling_params": {**payload["sampling_params"], **extra.get("sampling_params", {})},
            }
            reply = http.post(
                "/generate", content=json.dumps(payload), headers={"Content-Type": "application/json"}
            )
            assert reply.status_code == 400, (extra, reply.text)
            assert words in reply.json()["error"]["message"], (extra, reply.text)


def test_one_bad_request_never_fails_its_batch_mates(servers):
    open_, _ = servers
    good = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "sampling_seed": 5}}
    bad = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "sampling_seed": 2**70}}
    with httpx.Client(base_url=open_.url, timeout=60) as http, ThreadPoolExecutor(8) as pool:
        statuses = list(
            pool.map(
                lambda b: http.post("/generate", json=b).status_code, [good] * 11 + [bad] * 2 + [good] * 11
            )
        )
    assert statuses.count(200) == 22 and statuses.count(400) == 2


class _FlakyEngine:
    """Fails any batch holding a row of 13 tokens; counts the rows it computed."""

    max_batch_size = 64

    def __init__(self) -> None:
        self.computed = 0
        self.pause_gate = PauseGate()  # the batcher holds work while the engine is paused (never here)

    def generate_rows(self, rows):
        if any(len(r.prompt_ids) == 13 for r in rows):
            raise RuntimeError("poisoned row")
        self.computed += len(rows)
        return [len(r.prompt_ids) for r in rows]


def row(n: int) -> RowSpec:
    return RowSpec(prompt_ids=[1] * n, sampling=SamplingParams(max_new_tokens=1))


def test_batcher_isolates_a_failing_request_and_drops_abandoned_ones():
    engine = _FlakyEngine()
    batcher = Batcher(engine, window_s=0.2, max_rows=64)
    try:
        futures: list[Future] = [
            batcher.submit([row(2)]),
            batcher.submit([row(13)]),
            batcher.submit([row(3), row(4)]),
            batcher.submit([row(5)] * 40, client_gone=lambda: True),  # its client hung up: not computed
        ]
        assert futures[0].result(10) == [2] and futures[2].result(10) == [3, 4]
        with pytest.raises(RuntimeError, match="poisoned"):
            futures[1].result(10)
        with pytest.raises(ClientGone):
            futures[3].result(10)
        assert engine.computed == 3 and batcher.dropped == 1
    finally:
        batcher.stop()


def test_client_gone_sees_a_closed_peer():
    left, right = socket.socketpair()
    request = Request(peer_host="127.0.0.1", connection=left)
    assert not request.client_gone()
    right.sendall(b"GET /next HTTP/1.1\r\n")  # a pipelined request is not a hang-up
    assert not request.client_gone()
    right.close()
    left.recv(100)
    assert request.client_gone()
    left.close()


def test_weight_endpoints_refuse_foreign_directories_and_masters(servers, tmp_path, capsys):
    open_, _ = servers
    with httpx.Client(base_url=open_.url, timeout=30) as http:
        reply = http.post("/update_weights_from_disk", json={"model_path": "/etc"})
        assert reply.status_code == 400 and "outside the directories" in reply.json()["message"]
        assert "--allowed-weight-dir" in reply.json()["message"]
        link = open_.weights.allowed_weight_dirs[0] / f"link_{id(tmp_path)}"
        link.symlink_to("/etc")  # inside by name, outside once resolved
        try:
            reply = http.post("/update_weights_from_disk", json={"model_path": str(link)})
            assert reply.status_code == 400 and "outside the directories" in reply.json()["message"]
        finally:
            link.unlink()
        group = {"master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
        started = time.monotonic()
        reply = http.post("/init_weights_update_group", json={**group, "master_address": "127.0.0.2"})
        assert reply.status_code == 400 and "neither the requesting trainer" in reply.json()["message"]
        assert time.monotonic() - started < 2.0  # refused without dialling
    assert warn_if_exposed("0.0.0.0", None) and "without --api-key" in capsys.readouterr().err
    assert not warn_if_exposed("0.0.0.0", "key") and not warn_if_exposed("127.0.0.1", None)
    assert not warn_if_exposed("::1", None)
