"""CPU servers behind the real ``sglang-router`` (PyPI wheel): load without retries, and the API key end to end."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from sapo_megatron.cli import free_port
from sapo_megatron.rollout.cpu_server import CPUServer
from sapo_megatron.rollout.sglang_client import SGLangClient
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams
from tests.rollout.conftest import NUM_LAYERS, engine_from

pytestmark = pytest.mark.slow  # sglang-router is part of the test extra: never skipped
GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}


@contextlib.contextmanager
def router_in_front(moe_dir, api_key: str | None = None) -> Iterator[str]:
    servers = [CPUServer(engine_from(moe_dir, seed=0), api_key=api_key).start() for _ in range(2)]
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *[s.url for s in servers],
    ]
    command += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    command += ["--api-key", api_key] if api_key else []
    router = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, router)
        yield url
    finally:
        router.terminate()
        router.wait(timeout=30)
        for server in servers:
            server.stop()


def _wait_healthy(url: str, router: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if router.poll() is not None:
            pytest.fail(f"sglang-router exited: {router.stderr.read()[-2000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail("sglang-router did not become healthy")


def test_client_through_the_router_needs_no_retry(moe_dir):
    requests = [
        GenerationRequest(
            prompt_ids=[1 + g % 50, 2, 3], n=4, sampling=SamplingParams(max_new_tokens=2), group_id=g
        )
        for g in range(64)
    ]
    with (
        router_in_front(moe_dir) as url,
        SGLangClient(url, num_layers=NUM_LAYERS, max_concurrency=128, timeout_s=120) as client,
    ):
        assert sum(len(g) for g in client.generate(requests)) == 256
        metrics = client.metrics()
        workers = httpx.get(url + "/workers", timeout=10).json()["workers"]
    assert metrics["rollout/transient_errors"] == 0 and metrics["rollout/retries"] == 0
    # The router reads tp_size / dp_size from /get_server_info of each worker.
    assert [w["metadata"]["tp_size"] for w in workers] == ["1", "1"] and all(w["is_healthy"] for w in workers)


def test_api_key_through_the_router(moe_dir):
    with router_in_front(moe_dir, api_key="k") as url, httpx.Client(timeout=60) as http:
        assert http.post(url + "/generate", json=GENERATE).status_code == 401
        headers = {"Authorization": "Bearer k"}
        with ThreadPoolExecutor(max_workers=64) as pool:
            codes = list(
                pool.map(lambda _: http.post(url + "/generate", json=GENERATE, headers=headers), range(128))
            )
    assert [reply.status_code for reply in codes] == [200] * 128
