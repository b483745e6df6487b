"""The CPU server's weight endpoints in one process (the colocated ``rollout.engine: cpu_http`` case), over HTTP."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sapo_megatron.rollout.cpu.server import CPUServer
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.tensor_transport import serialize_named_tensors
from tests.rollout.conftest import engine_from, load, reference_logprobs

LOGP_ATOL = 1e-4
PROMPTS = ([1, 2, 3, 4], [9, 8, 7])


@pytest.fixture
def server(moe_dir):
    with CPUServer(engine_from(moe_dir, seed=0), dist_timeout_s=3.0) as srv:
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def greedy_logprobs(http: httpx.Client, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
        "return_logprob": True,
    }
    entries = http.post("/generate", json=body).json()["meta_info"]["output_token_logprobs"]
    return [e[1] for e in entries], [e[0] for e in entries]


def assert_serves(http: httpx.Client, model: torch.nn.Module) -> None:
    for prompt in PROMPTS:
        ids, logps = greedy_logprobs(http, prompt)
        np.testing.assert_allclose(
            logps, reference_logprobs(model, prompt + ids, len(prompt)), atol=LOGP_ATOL
        )


def test_tensors_sent_in_process_are_served(http, moe_dir, moe_dir_b):
    named = sorted(load_file(str(moe_dir_b / "model.safetensors")).items())  # checkpoint (per-expert) names
    body = {
        "serialized_named_tensors": [serialize_named_tensors(named)],
        "load_format": None,
        "flush_cache": True,
    }
    reply = http.post("/update_weights_from_tensor", json=body)
    assert reply.status_code == 200 and reply.json() == {"success": True, "message": "Success"}
    assert_serves(http, load(moe_dir_b))
    assert http.get("/get_weight_version").json() == {"weight_version": "1"}

    # A weight_version label is kept and reported, as SGLang does.
    named_a = sorted(load_file(str(moe_dir / "model.safetensors")).items())
    body = {"serialized_named_tensors": [serialize_named_tensors(named_a)], "weight_version": "step-7"}
    reply = http.post("/update_weights_from_tensor", json=body).json()
    assert reply == {"success": True, "message": "Success Weight version updated to step-7."}
    assert_serves(http, load(moe_dir))
    assert http.get("/get_server_info").json()["weight_version"] == "step-7"
    meta = http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}).json()
    assert meta["meta_info"]["weight_version"] == "step-7"


def test_weight_update_sessions_follow_sglang_and_the_client_opens_and_closes_one(server, http, moe_dir_b):
    """SGLang 0.5.23's /begin_weight_update and /end_weight_update replies (weight_updater.py), and the client's
    tensor update inside one session per worker."""
    assert http.post("/end_weight_update", json={}).json() == {
        "success": False,
        "message": "no weight-update session is open; call begin_weight_update() first",
    }
    assert http.post("/begin_weight_update", json={"selector": "all"}).json() == {
        "success": True,
        "message": "Success",
    }
    second = http.post("/begin_weight_update", json={})
    assert second.status_code == 400 and "already open" in second.json()["message"]
    assert http.post("/end_weight_update", json={}).status_code == 200
    assert http.post("/begin_weight_update", json={"selector": "both"}).status_code == 400

    named = sorted(load_file(str(moe_dir_b / "model.safetensors")).items())
    with SGLangClient(server.url, max_retries=0, serializer=serialize_named_tensors) as client:
        client.update_weights_from_tensors(named[: len(named) // 2])
        client.update_weights_from_tensors(named[len(named) // 2 :])
        assert server.weights.session_open  # one session for both buckets
        client.finish_weight_update()
    assert not server.weights.session_open and server.weights.sessions_closed == 2  # 1 by hand above
    assert_serves(http, load(moe_dir_b))


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"serialized_named_tensors": "x"}, 400, "must be list"),
        ({}, 400, "'serialized_named_tensors' is required"),
        ({"serialized_named_tensors": ["x"], "flush": True}, 400, "unknown fields ['flush']"),
    ],
)
def test_malformed_tensor_requests_get_fastapis_validation_reply(http, body, status, words):
    reply = http.post("/update_weights_from_tensor", json=body)
    assert reply.status_code == status
    payload = reply.json()
    assert payload["object"] == "error" and payload["code"] == 400 and words in payload["message"]


def test_refused_tensor_updates_change_nothing(http, moe_dir):
    cases = [
        ([("model.nope.weight", torch.zeros(2))], None, "unknown weight name"),
        ([("model.embed_tokens.weight", torch.zeros(3, 3))], None, "shape"),
        # a plain (name, tensor) list labelled as a flattened bucket (SGLang's load_format for one)
        ([("model.norm.weight", torch.zeros(32))], "flattened_bucket", "a flattened bucket is"),
        ([("model.norm.weight", torch.zeros(32))], "safetensors", "load_format 'safetensors'"),
    ]
    for named, load_format, words in cases:
        body = {"serialized_named_tensors": [serialize_named_tensors(named)], "load_format": load_format}
        reply = http.post("/update_weights_from_tensor", json=body)
        assert (
            reply.status_code == 400 and reply.json()["success"] is False and words in reply.json()["message"]
        )
    assert http.get("/get_weight_version").json() == {"weight_version": "0"}
    assert_serves(http, load(moe_dir))


def test_distributed_endpoints_refuse_before_any_transfer(http):
    nccl = {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "backend": "nccl",
    }
    reply = http.post("/init_weights_update_group", json=nccl)
    if not torch.cuda.is_available():
        assert reply.status_code == 400 and "needs CUDA" in reply.json()["message"]
    reply = http.post(
        "/update_weights_from_distributed", json={"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}
    )
    assert reply.status_code == 400
    assert (
        "Group weight_update_group not in []. Please call `init_weights_update_group` first"
        in reply.json()["message"]
    )
    reply = http.post("/destroy_weights_update_group", json={"group_name": "g"})
    assert reply.status_code == 400 and reply.json() == {
        "success": False,
        "message": "The group to be destroyed does not exist.",
    }
    assert http.post("/init_weights_update_group", json={"master_address": "x"}).json()["object"] == "error"


def test_info_endpoints_follow_sglang(http, server, moe_dir):
    info = http.get("/get_server_info").json()
    assert info["tp_size"] == 1 and info["dp_size"] == 1 and info["enable_return_routed_experts"] is True
    assert info["weight_version"] == "0" and info["model_path"] == str(moe_dir) and info["port"] > 0
    model = http.get("/get_model_info").json()
    assert {
        "model_path",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
        "weight_version",
    } <= set(model)
    assert model["is_generation"] is True and model["model_path"] == str(moe_dir)
    assert http.get("/nope").status_code == 404 and http.get("/nope").json() == {"detail": "Not Found"}
    assert http.get("/generate").status_code == 405
    assert http.post("/flush_cache").text.startswith("Cache flushed.")
    assert http.get("/health_generate").status_code == 200
