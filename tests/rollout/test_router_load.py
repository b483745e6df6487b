"""CPU servers behind the real ``sglang-router`` (PyPI wheel): load without retries, and the API key end to end."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from sapo_megatron.rollout.cpu.server import CPUServer
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams
from tests.rollout.conftest import NUM_LAYERS, engine_from
from tests.servers import router

pytestmark = pytest.mark.slow  # sglang-router is part of the test extra: never skipped
GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}


@contextlib.contextmanager
def router_in_front(moe_dir, log: Path, api_key: str | None = None) -> Iterator[str]:
    """Two in-process CPU servers behind the real router, yielded once it lists both (tests/servers.router)."""
    servers = [CPUServer(engine_from(moe_dir, seed=0), api_key=api_key).start() for _ in range(2)]
    try:
        with router([s.url for s in servers], log, api_key=api_key) as url:
            yield url
    finally:
        for server in servers:
            server.stop()


def test_client_through_the_router_needs_no_retry(moe_dir, tmp_path):
    requests = [
        GenerationRequest(
            prompt_ids=[1 + g % 50, 2, 3], n=4, sampling=SamplingParams(max_new_tokens=2), group_id=g
        )
        for g in range(64)
    ]
    with (
        router_in_front(moe_dir, tmp_path / "router.log") as url,
        SGLangClient(url, num_layers=NUM_LAYERS, max_concurrency=128, timeout_s=120) as client,
    ):
        assert sum(len(g) for g in client.generate(requests)) == 256
        metrics = client.metrics()
        workers = httpx.get(url + "/workers", timeout=10).json()["workers"]
    assert metrics["rollout/transient_errors"] == 0 and metrics["rollout/retries"] == 0
    # The router reads tp_size / dp_size from /get_server_info of each worker.
    assert [w["metadata"]["tp_size"] for w in workers] == ["1", "1"] and all(w["is_healthy"] for w in workers)


def test_api_key_through_the_router(moe_dir, tmp_path):
    with (
        router_in_front(moe_dir, tmp_path / "router.log", api_key="k") as url,
        httpx.Client(timeout=60) as http,
    ):
        assert http.post(url + "/generate", json=GENERATE).status_code == 401
        headers = {"Authorization": "Bearer k"}
        with ThreadPoolExecutor(max_workers=64) as pool:
            codes = list(
                pool.map(lambda _: http.post(url + "/generate", json=GENERATE, headers=headers), range(128))
            )
    assert [reply.status_code for reply in codes] == [200] * 128
