"""SGLangClient against the CPU server over real HTTP on 127.0.0.1."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from sapo_megatron.rollout.cpu.server import CPUServer
from sapo_megatron.rollout.protocol import decode_routed_experts
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams
from tests.rollout.conftest import NUM_LAYERS, TOP_K, engine_from, load, reference_logprobs, reference_routing

LOGP_ATOL = 1e-4  # fp32, see test_cpu_engine


@pytest.fixture
def server(moe_dir):
    with CPUServer(engine_from(moe_dir, seed=0)) as srv:
        yield srv


@pytest.fixture
def client(server):
    with SGLangClient(server.url, num_layers=NUM_LAYERS, max_concurrency=8, timeout_s=60) as c:
        yield c


def make_requests(sampling, routed=False, n=3):
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12]]
    return [
        GenerationRequest(prompt_ids=p, n=n, sampling=sampling, return_routed_experts=routed, group_id=i)
        for i, p in enumerate(prompts)
    ]


def test_generation_logprobs_and_routing_over_http(client, moe_dir):
    reference = load(moe_dir)
    groups = client.generate(
        make_requests(SamplingParams(max_new_tokens=8, stop_token_ids=(4,)), routed=True)
    )
    assert [[(s.group_id, s.sample_index) for s in g] for g in groups] == [
        [(i, j) for j in range(3)] for i in range(3)
    ]
    for group in groups:
        for s in group:
            assert 1 <= len(s.response_ids) <= 8
            assert s.finish_reason == ("stop" if s.response_ids[-1] == 4 else "length")
            expected = reference_logprobs(reference, s.token_ids, len(s.prompt_ids))
            np.testing.assert_allclose(s.rollout_logp, expected, atol=LOGP_ATOL)
            assert s.routed_experts.shape == (len(s.token_ids) - 1, NUM_LAYERS, TOP_K)  # top_k inferred
            np.testing.assert_array_equal(
                np.sort(s.routed_experts, axis=-1), reference_routing(reference, s.token_ids)
            )
    metrics = client.metrics()
    assert metrics["rollout/samples"] == 9 and metrics["rollout/retries"] == 0


def test_routes_from_a_start_position_over_http(client, server, moe_dir):
    """``routed_experts_start_len`` (SGLang's): the rows of the positions from the start on, as in a full reply;
    a start past the prompt is refused with 400."""
    reference = load(moe_dir)
    sampling = SamplingParams(max_new_tokens=5, seed=1)
    prompt = [5, 6, 7, 8, 9, 10]
    request = GenerationRequest(
        prompt_ids=prompt,
        n=2,
        sampling=sampling,
        return_routed_experts=True,
        group_id=0,
        routed_experts_start=4,
    )
    for s in client.generate([request])[0]:
        assert s.routed_experts_start == 4 and s.routed_experts.shape[0] == len(s.token_ids) - 1 - 4
        expected = reference_routing(reference, s.token_ids)[4:]
        np.testing.assert_array_equal(np.sort(s.routed_experts, axis=-1), expected)
    body = {"input_ids": prompt, "return_routed_experts": True, "routed_experts_start_len": 7}
    reply = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    assert reply.status_code == 400 and "routed_experts_start_len 7 is not in [0, 6]" in reply.text


def test_score_over_http(client, moe_dir):
    reference = load(moe_dir)
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    scored = client.score(seqs, [2, 1])
    np.testing.assert_allclose(scored[0], reference_logprobs(reference, seqs[0], 2), atol=LOGP_ATOL)
    np.testing.assert_allclose(scored[1], reference_logprobs(reference, seqs[1], 1), atol=LOGP_ATOL)


def test_weight_sync_from_disk_changes_served_outputs(client, moe_dir_b):
    greedy = make_requests(SamplingParams(temperature=0.0, max_new_tokens=6), n=1)
    before = client.generate(greedy)
    client.update_weights_from_disk(str(moe_dir_b))
    after = client.generate(greedy)
    reference_b = load(moe_dir_b)
    assert [g[0].rollout_logp for g in before] != [g[0].rollout_logp for g in after]
    for group in after:
        s = group[0]
        np.testing.assert_allclose(
            s.rollout_logp, reference_logprobs(reference_b, s.token_ids, len(s.prompt_ids)), atol=LOGP_ATOL
        )


def test_server_speaks_the_sglang_subset(server, moe_dir):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/health_generate").status_code == 200
        assert http.get("/get_model_info").json()["model_path"] == str(moe_dir)
        assert http.get("/get_server_info").json()["enable_return_routed_experts"] is True
        assert http.post("/flush_cache").status_code == 200
        batch = http.post(
            "/generate",
            json={
                "input_ids": [[1, 2, 3], [4, 5]],
                "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": 0,
                "return_routed_experts": True,
                "rid": ["a", "b"],
            },
        ).json()
        assert [r["meta_info"]["id"] for r in batch] == ["a", "b"]
        first = batch[0]["meta_info"]
        assert first["finish_reason"] == {"type": "length", "length": 3}
        assert first["prompt_tokens"] == 3 and first["completion_tokens"] == 3
        assert first["input_token_logprobs"][0] == [None, 1, None] and len(first["input_token_logprobs"]) == 3
        assert [e[1] for e in first["output_token_logprobs"]] == batch[0]["output_ids"]
        routed = decode_routed_experts(
            first["routed_experts"], num_rows=5, num_layers=NUM_LAYERS, top_k=TOP_K
        )
        assert routed.shape == (5, NUM_LAYERS, TOP_K)
        bad = http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_token": 3}})
        assert bad.status_code == 400 and "max_new_token" in bad.json()["error"]["message"]
        assert http.post("/generate", json={"text": "hi"}).status_code == 400
        failed = http.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
        assert failed.status_code == 400 and failed.json()["success"] is False


def test_health_reports_each_server(server):
    with SGLangClient([server.url, "http://127.0.0.1:9"], max_retries=0) as client:
        assert client.server_health() == {server.url: True, "http://127.0.0.1:9": False}
        assert client.health() is False


def test_serve_decodes_text_with_the_char_tokenizer(moe_dir, tmp_path):
    import shutil

    from sapo_megatron.data.tokenizer import CharTokenizer
    from sapo_megatron.rollout.cpu.server import serve

    model_dir = tmp_path / "with_tokenizer"
    shutil.copytree(moe_dir, model_dir)
    tokenizer = CharTokenizer()  # 52 ids, inside the test model's 64
    tokenizer.save(model_dir)
    server = serve(model_dir, port=0, num_threads=1, block=False)
    try:
        reply = httpx.post(
            f"{server.url}/generate",
            json={
                "input_ids": tokenizer.encode("1+2="),
                "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            },
            timeout=30,
        ).json()
        ids = reply["output_ids"]
        # The random model may emit ids beyond the tokenizer's 52; then the text is empty, the ids stay.
        expected = tokenizer.decode(ids) if max(ids) < tokenizer.vocab_size else ""
        assert len(ids) == 4 and reply["text"] == expected
    finally:
        server.stop()


def test_module_entry_point_serves(moe_dir):
    import subprocess
    import sys
    import time

    from tests.ports import free_port

    port = free_port()
    command = [
        sys.executable,
        "-m",
        "sapo_megatron.rollout.cpu.server",
        "--model",
        str(moe_dir),
        "--port",
        str(port),
    ]
    process = subprocess.Popen(
        [*command, "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            pytest.fail("the server did not come up")
        reply = httpx.post(
            f"http://127.0.0.1:{port}/generate",
            json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
        )
        assert len(reply.json()["output_ids"]) == 2
    finally:
        process.terminate()
        process.wait(timeout=30)


API_KEY = "s3cret-key"


@pytest.fixture
def keyed_server(moe_dir):
    with CPUServer(engine_from(moe_dir, seed=0), api_key=API_KEY) as srv:
        yield srv


def test_api_key_is_required_where_sglang_requires_it(keyed_server):
    generate = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    with httpx.Client(base_url=keyed_server.url, timeout=30) as http:
        for method, path, body in [
            ("POST", "/generate", generate),
            ("GET", "/get_server_info", None),
            ("GET", "/get_model_info", None),
            ("POST", "/flush_cache", None),
            ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
            ("POST", "/init_weights_update_group", {}),
            ("GET", "/no_such_path", None),
        ]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
                reply = http.request(method, path, json=body, headers=headers)
                assert reply.status_code == 401 and reply.json() == {"error": "Unauthorized"}, (path, headers)
        # /health* are exempt (probes carry no secret).
        assert http.get("/health").status_code == 200 and http.get("/health_generate").status_code == 200
        for headers in (
            {"Authorization": f"Bearer {API_KEY}"},
            {"authorization": f"bearer {API_KEY}"},
            {"x-api-key": API_KEY},
        ):
            assert http.post("/generate", json=generate, headers=headers).status_code == 200, headers
        info = http.get("/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"})
        assert info.status_code == 200 and API_KEY not in info.text and "api_key" not in info.json()
