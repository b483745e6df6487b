"""The rollout topology against the REAL sglang-router (PyPI wheel) in front of two CPU servers in their own
processes: worker discovery, health waits, the routed-experts probe, generation through the router, and weight
updates that reach every worker (the router has no weight-update routes)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from sapo_megatron.rollout.base import RolloutError
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.sglang.topology import list_router_workers, resolve_topology
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams
from tests.ports import free_port
from tests.rollout.conftest import NUM_LAYERS, TOP_K
from tests.rollout.server_process import ServerProcess
from tests.servers import cpu_server, router


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, moe_dir):
    logs = tmp_path_factory.mktemp("router_logs")
    with (
        cpu_server(moe_dir, logs / "w1.log") as w1,
        cpu_server(moe_dir, logs / "w2.log") as w2,
        router([w1, w2], logs / "router.log") as r,
    ):
        yield {"workers": [w1, w2], "router": r}


def model_info(url: str) -> dict:
    return httpx.get(url + "/get_model_info", timeout=10).json()


def test_router_only_discovers_its_workers(cluster):
    topology = resolve_topology(router_url=cluster["router"], timeout_s=30, log=lambda _: None)
    assert sorted(topology.workers) == sorted(cluster["workers"])
    assert topology.tp_sizes == (1, 1)
    assert topology.generate_via_router and topology.generation_urls == (cluster["router"],)


def test_discovery_waits_for_workers_the_router_registers_late(moe_dir, tmp_path):
    """The router answers /health before it has registered its --worker-urls (a background job that retries a
    worker that is not up yet); discovery through it waits for them instead of failing."""
    port = free_port()
    late = f"http://127.0.0.1:{port}"
    with router([late], tmp_path / "router.log", wait_for_workers=False) as r:
        with httpx.Client(timeout=10) as http:
            assert list_router_workers(http, r) == []  # healthy router, no workers yet
        found: dict = {}
        discovery = threading.Thread(
            target=lambda: found.update(
                topology=resolve_topology(router_url=r, timeout_s=120, log=lambda _: None)
            )
        )
        discovery.start()
        time.sleep(1.0)
        worker = ServerProcess(
            "--model-path", str(moe_dir), "--host", "127.0.0.1", "--port", str(port), "--threads", "1"
        )
        try:
            discovery.join(timeout=150)
        finally:
            worker.stop()
    assert found["topology"].workers == (late,) and found["topology"].generation_urls == (r,)


def test_runs_needing_routes_bypass_the_router_that_drops_them(cluster):
    said: list[str] = []
    topology = resolve_topology(
        urls=cluster["workers"], router_url=cluster["router"], need_routes=True, timeout_s=30, log=said.append
    )
    assert not topology.generate_via_router and topology.generation_urls == tuple(cluster["workers"])
    assert any("drops return_routed_experts" in line for line in said)
    # the fact behind it: the same request has routes from a worker and none through the router
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
    direct = httpx.post(cluster["workers"][0] + "/generate", json=body, timeout=30).json()
    routed = httpx.post(cluster["router"] + "/generate", json=body, timeout=30).json()
    assert direct["meta_info"].get("routed_experts") and not routed["meta_info"].get("routed_experts")


def test_endpoints_file_is_waited_for(cluster, tmp_path):
    path = tmp_path / "endpoints.json"
    said: list[str] = []

    def write_later() -> None:
        time.sleep(1.5)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"router_url": cluster["router"], "workers": cluster["workers"]}))
        tmp.replace(path)

    writer = threading.Thread(target=write_later)
    writer.start()
    topology = resolve_topology(endpoints_file=str(path), timeout_s=30, log=said.append)
    writer.join()
    assert topology.workers == tuple(cluster["workers"]) and topology.router == cluster["router"]
    assert said and "waiting for the rollout job to write" in said[0]


def test_missing_endpoints_file_and_dead_worker_time_out_with_names(cluster, tmp_path):
    missing = tmp_path / "never.json"
    with pytest.raises(RolloutError, match=r"never\.json did not appear within"):
        resolve_topology(endpoints_file=str(missing), timeout_s=1.0, log=lambda _: None)
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    with pytest.raises(RolloutError, match=r"1 rollout worker\(s\) not healthy after .*127\.0\.0\.1:9"):
        resolve_topology(urls=[cluster["workers"][0], dead], timeout_s=1.5, log=lambda _: None)


def test_generation_through_the_router_and_weight_updates_on_every_worker(cluster, moe_dir_b):
    workers, before = cluster["workers"], [model_info(u)["weight_version"] for u in cluster["workers"]]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, seed=5)
    requests = [GenerationRequest(prompt_ids=[3, 4, 5], n=4, sampling=sampling, group_id=g) for g in range(4)]
    with SGLangClient(workers, router_url=cluster["router"], num_layers=NUM_LAYERS, top_k=TOP_K) as client:
        samples = [s for group in client.generate(requests) for s in group]
        assert len(samples) == 16 and client.metrics()["rollout/transient_errors"] == 0
        # the router answers 404 to this: each worker loads it
        client.update_weights_from_disk(str(moe_dir_b))
    after = [model_info(u) for u in workers]
    assert [int(info["weight_version"]) for info in after] == [int(v) + 1 for v in before]
    assert all(info["model_path"] == str(moe_dir_b) for info in after)


def test_router_failure_fails_over_to_the_workers(cluster):
    dead_router = "http://127.0.0.1:9"
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3, seed=1)
    with SGLangClient(cluster["workers"], router_url=dead_router, backoff_s=0.01, cooldown_s=60) as client:
        groups = client.generate([GenerationRequest(prompt_ids=[1, 2], n=2, sampling=sampling, group_id=0)])
        counters = client.metrics()
    assert len(groups[0]) == 2 and counters["rollout/failovers"] >= 1
