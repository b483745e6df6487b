"""Memory release and resume (colocation): the client's state machine against the CPU stand-in, and the stand-in's
replies and crashes as SGLang 0.5.23 gives them (see sapo_megatron/rollout/sglang/memory.py for the source read)."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
from safetensors.torch import load_file

from sapo_megatron.rollout.cpu.server import CPUServer
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.sglang.memory import MemoryStateError
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams
from sapo_megatron.rollout.weight_checksum import expected_checksums, mismatches
from tests.rollout.conftest import engine_from, load, reference_logprobs

SCORED = [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.fixture
def server(moe_dir):
    with CPUServer(engine_from(moe_dir, seed=0)) as srv:
        yield srv


@pytest.fixture
def client(server):
    with SGLangClient(server.url, timeout_s=60, max_retries=0) as c:
        yield c


def _long_generation(client: SGLangClient, errors: list | None = None) -> threading.Thread:
    """A generation that runs for a while on a thread (greedy, many tokens, many samples); its error, if any,
    lands in ``errors``."""
    sampling = SamplingParams(max_new_tokens=64, temperature=0.0, stop_token_ids=())
    requests = [GenerationRequest(group_id=0, prompt_ids=[1, 2, 3], sampling=sampling, n=8)]

    def run() -> None:
        try:
            client.generate(requests)
        except Exception as exc:
            (errors if errors is not None else []).append(exc)
            if errors is None:
                raise

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_release_resume_cycle_tracks_tags_and_refuses_what_would_kill_the_server(client, server, moe_dir):
    client.release_memory()  # [] / None: all three, as SGLang
    assert server.memory.released == {"kv_cache", "weights", "cuda_graph"}
    assert client.released_memory() == {server.url: ["kv_cache", "weights", "cuda_graph"]}
    with pytest.raises(MemoryStateError, match="already released"):
        client.release_memory(["weights"])
    with pytest.raises(
        MemoryStateError, match=r"generate needs memory \['kv_cache', 'weights', 'cuda_graph'\]"
    ):
        client.generate(
            [GenerationRequest(group_id=0, prompt_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2), n=1)]
        )
    with pytest.raises(MemoryStateError, match="update_weights_from_tensors needs memory"):
        client.update_weights_from_tensors([])

    client.resume_memory(["weights"])
    assert server.memory.released == {"kv_cache", "cuda_graph"}
    with pytest.raises(MemoryStateError, match=r"\['weights'\] is not released.*KeyError"):
        client.resume_memory(["weights"])  # a double resume: SGLang's scheduler would raise KeyError and die
    assert server.memory.released == {"kv_cache", "cuda_graph"}  # nothing was sent
    with pytest.raises(MemoryStateError, match="score needs memory"):
        client.score([SCORED], 1)  # the KV cache is still released
    client.resume_memory(["kv_cache", "cuda_graph"])
    assert server.memory.released == set() and client.released_memory() == {server.url: []}
    got = client.score([SCORED], 1)[0]
    np.testing.assert_allclose(got, reference_logprobs(load(moe_dir), SCORED, 1), atol=1e-4)
    assert client.health()


def test_unknown_or_repeated_tags_are_refused_before_sending(client, server):
    with pytest.raises(MemoryStateError, match=r"unknown memory tag\(s\) \['gpu'\]"):
        client.release_memory(["gpu"])
    with pytest.raises(MemoryStateError, match="name a tag twice"):
        client.release_memory(["weights", "weights"])
    assert server.memory.released == set()


def test_release_while_this_clients_requests_run_is_refused(client, server):
    thread = _long_generation(client)
    _wait_until(lambda: client.fleet.busy > 0)
    with pytest.raises(MemoryStateError, match=r"while 1 request\(s\) run"):
        client.release_memory()
    thread.join(timeout=120)
    assert server.memory.released == set() and not server.stopped
    client.release_memory(["kv_cache"])  # idle now
    assert server.memory.released == {"kv_cache"}


def test_release_while_another_clients_requests_run_is_refused_by_the_idle_probe(client, server):
    with SGLangClient(server.url, timeout_s=60) as other:
        thread = _long_generation(other)
        _wait_until(lambda: server.batcher.pending > 0)
        with pytest.raises(MemoryStateError, match="not idle"):
            client.release_memory()
        thread.join(timeout=120)
    assert server.memory.released == set() and client.health()


def test_stand_in_dies_of_what_kills_sglang(moe_dir):
    """SGLang's scheduler raises (AssertionError on a busy release, KeyError on resuming what is not released) and
    the server goes down: the stand-in stops and the request gets no reply."""
    with (
        CPUServer(engine_from(moe_dir, seed=0)) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        reply = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert reply.status_code == 200 and reply.json() is None  # SGLang: 200, body null
        assert http.post("/flush_cache").status_code == 200
        with pytest.raises(httpx.TransportError):
            http.post("/resume_memory_occupation", json={"tags": ["weights"]})
        _wait_until(lambda: server.stopped)
        with pytest.raises(httpx.TransportError):
            http.get("/health")
    errors: list = []
    with (
        CPUServer(engine_from(moe_dir, seed=0)) as server,
        SGLangClient(server.url, timeout_s=60, max_retries=0) as c,
    ):
        thread = _long_generation(c, errors)
        _wait_until(lambda: server.batcher.pending > 0)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.post("/flush_cache").status_code == 400  # the idle probe's signal
            with pytest.raises(httpx.TransportError):
                http.post("/release_memory_occupation", json={"tags": []})
        thread.join(timeout=60)
        assert server.stopped
    assert errors and "transport" in str(errors[0])  # its requests died with the server


def _served_scores(client: SGLangClient) -> np.ndarray:
    return np.array(client.score([SCORED], 1)[0])


@pytest.mark.slow  # two servers' worth of scoring and a sync; 9 s on a loaded 2-core machine
@pytest.mark.parametrize("backup", [False, True])
def test_memory_saver_returns_garbage_weights_unless_resent_or_backed_up(moe_dir, moe_dir_b, backup):
    """With --enable-memory-saver, released weights come back as garbage (sglang #6367) unless the server keeps a
    CPU backup; re-sending the weights after the resume (slime's order) restores the policy exactly."""
    engine = engine_from(moe_dir, seed=0)
    with (
        CPUServer(engine, memory_saver=True, weights_cpu_backup=backup) as server,
        SGLangClient(server.url, timeout_s=60, max_retries=0) as client,
    ):
        before = _served_scores(client)
        client.release_memory()
        client.resume_memory()
        after = _served_scores(client)
        if backup:
            np.testing.assert_array_equal(after, before)
            return
        assert np.abs(after - before).max() > 0.1  # garbage
        client.release_memory()
        client.resume_memory(["weights"])
        named = sorted(load_file(str(moe_dir_b / "model.safetensors")).items())
        client.update_weights_from_tensors(named)
        client.finish_weight_update(flush_cache=False)
        client.resume_memory(["kv_cache", "cuda_graph"])
        client.flush_cache()
        np.testing.assert_allclose(
            _served_scores(client), reference_logprobs(load(moe_dir_b), SCORED, 1), atol=1e-4
        )


def test_stand_in_checksums_are_sglangs_served_layout_of_the_checkpoint(client, server, moe_dir, moe_dir_b):
    """The stand-in's /weights_checker reports SGLang's served names (qkv_proj, w13_weight, padded vocab) with
    the hashes of the checkpoint it serves; after a sync of other weights every changed tensor is named."""
    checkpoint = sorted(load_file(str(moe_dir / "model.safetensors")).items())
    served = client.weight_checksums()[server.url]
    assert (
        "model.layers.0.self_attn.qkv_proj.weight" in served
        and "model.layers.1.mlp.experts.w13_weight" in served
    )
    assert not mismatches(expected_checksums(checkpoint), served)
    other = sorted(load_file(str(moe_dir_b / "model.safetensors")).items())
    client.update_weights_from_tensors(other[:3])  # three tensors only
    client.finish_weight_update()
    changed = mismatches(expected_checksums(checkpoint), client.weight_checksums()[server.url])
    before = expected_checksums(checkpoint)
    differ = sorted(n for n, v in expected_checksums(other[:3]).items() if v != before[n])
    assert changed == differ and len(differ) == 2  # embeddings and lm_head (both models' norms are ones)


def test_flattened_buckets_update_the_stand_in(server, moe_dir_b):
    """rollout.colocate's sync: one flattened bucket per dtype (SGLang's load_format flattened_bucket)."""
    named = sorted(load_file(str(moe_dir_b / "model.safetensors")).items())
    with SGLangClient(server.url, timeout_s=60, max_retries=0, flatten_buckets=True) as flat:
        half = len(named) // 2
        flat.update_weights_from_tensors(named[:half])
        flat.update_weights_from_tensors(named[half:])
        flat.finish_weight_update()
        np.testing.assert_allclose(
            _served_scores(flat), reference_logprobs(load(moe_dir_b), SCORED, 1), atol=1e-4
        )
        assert not mismatches(expected_checksums(named), flat.weight_checksums()[server.url])
