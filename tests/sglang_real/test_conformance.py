"""What the project sends to SGLang and reads back, checked against the real SGLang server on CPU
(tools/sglang_cpu; one server for the tier, see conftest.py) and against transformers in float32.

Each test asserts numbers: served log-probs equal ``log_softmax`` of the reference logits (temperature-scaled,
unfiltered by top-p, as the stand-in's docs claim), scoring equals the reference input log-probs, routes equal the
reference router's top-k per position, and a weight update changes what the server computes.
"""

from __future__ import annotations

import copy
from pathlib import Path

import httpx
import numpy as np
import pytest
import safetensors.torch
import torch

from sapo_megatron.checkpoint.mapping import hf_expected_shapes
from sapo_megatron.data.tokenizer import CharTokenizer
from sapo_megatron.defaults import DEMO_MODEL
from sapo_megatron.model.arch import QwenArch
from sapo_megatron.rollout.base import RolloutError
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams
from sapo_megatron.weight_sync.hf_export import write_hf_checkpoint
from tests.servers import save_demo_model
from tests.sglang_real.conftest import API_KEY, NUM_LAYERS, TOP_K

FP32_TOL = 2e-4  # float32 server vs float32 transformers (different kernels, same math)
BF16_TOL = 1e-2  # bf16 weights and activations; measured at most 1.8e-3 (docs/cluster.md)
EOS = DEMO_MODEL["eos_token_id"]
PROMPTS = [[1, 10, 11, 12, 13], [1, 20, 21, 22, 23, 24, 25]]


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def reference_logp(model: torch.nn.Module, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``[len(ids) - 1]``: log p(ids[t] | ids[:t]) at ``temperature``."""
    logits = reference_logits(model, ids)[:-1] / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_sampled_logprobs_are_temperature_scaled_and_unfiltered(client, reference):
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8, seed=123)
    requests = [
        GenerationRequest(prompt_ids=p, n=2, sampling=sampling, group_id=g) for g, p in enumerate(PROMPTS)
    ]
    # sampling_seed is accepted; SGLang applies it only with --enable-deterministic-inference, which the CPU's
    # torch_native attention backend does not support (so repeats are not asserted here)
    groups = client.generate(requests)
    for prompt, group in zip(PROMPTS, groups):
        for sample in group:
            # SGLang stops at the model's eos_token_id (2) unless ignore_eos, even with no stop_token_ids
            assert (len(sample.response_ids) == 8 and sample.finish_reason == "length") or (
                sample.finish_reason == "stop" and sample.response_ids[-1] == EOS
            ), sample
            ids = prompt + sample.response_ids
            expected = reference_logp(reference, ids, temperature=0.7)[len(prompt) - 1 :]
            assert np.allclose(sample.rollout_logp, expected.numpy(), atol=FP32_TOL), (
                sample.rollout_logp,
                expected,
            )
            raw = reference_logp(reference, ids)[len(prompt) - 1 :]
            assert not np.allclose(sample.rollout_logp, raw.numpy(), atol=1e-3)  # not the T=1 distribution


def test_greedy_logprobs_stop_ids_and_top_logprobs(client, reference, sglang_url):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    [[sample]] = client.generate([GenerationRequest(prompt_ids=PROMPTS[0], n=1, sampling=greedy, group_id=0)])
    ids = PROMPTS[0] + sample.response_ids
    logits = reference_logits(reference, ids)
    assert sample.response_ids == logits[len(PROMPTS[0]) - 1 : -1].argmax(-1).tolist()
    # greedy rows report log_softmax(logits) whatever the temperature
    assert np.allclose(
        sample.rollout_logp, reference_logp(reference, ids)[len(PROMPTS[0]) - 1 :], atol=FP32_TOL
    )

    # a stop id at the third greedy token ends there, kept in the output (no_stop_trim), finish_reason stop
    stop = sample.response_ids[2]
    first = sample.response_ids.index(stop)
    stopping = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop,))
    [[stopped]] = client.generate(
        [GenerationRequest(prompt_ids=PROMPTS[0], n=1, sampling=stopping, group_id=0)]
    )
    assert stopped.response_ids == sample.response_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    # the same stop as the last allowed token: still stop (SGLang 0.5.23 checks stop tokens before the length cap;
    # our CPU engine must decide alike – tests/rollout/test_cpu_engine.py)
    last = SamplingParams(temperature=0.0, max_new_tokens=first + 1, stop_token_ids=(stop,))
    [[at_cap]] = client.generate([GenerationRequest(prompt_ids=PROMPTS[0], n=1, sampling=last, group_id=0)])
    assert (at_cap.response_ids, at_cap.finish_reason) == (sample.response_ids[: first + 1], "stop")

    # top log-probs (SGLang field names): sorted, the first is the greedy token, values from the reference
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 3},
        "return_logprob": True,
        "top_logprobs_num": 3,
    }
    reply = httpx.post(sglang_url + "/generate", json=body, headers=_auth(), timeout=60).json()
    top = reply["meta_info"]["output_top_logprobs"]
    assert len(top) == 3 and all(len(row) == 3 for row in top)
    for t, row in enumerate(top):
        expected = torch.log_softmax(logits[len(PROMPTS[0]) - 1 + t], -1).topk(3)
        assert [entry[1] for entry in row] == expected.indices.tolist()
        assert np.allclose([entry[0] for entry in row], expected.values.numpy(), atol=FP32_TOL)


def test_teacher_scoring_matches_reference_input_logprobs(client, reference):
    # 51 = the last vocabulary id, which SGLang reports as token 0 in input_token_logprobs (protocol.py
    # _clipped_input_id); its log-prob is still right
    sequences = [PROMPTS[0] + [30, 51, 32], PROMPTS[1] + [40, 51]]
    starts = [len(PROMPTS[0]), len(PROMPTS[1])]
    scores = client.score(sequences, starts)
    for ids, start, values in zip(sequences, starts, scores):
        expected = reference_logp(reference, ids)[start - 1 :]
        assert len(values) == len(ids) - start
        assert np.allclose(values, expected.numpy(), atol=FP32_TOL)


def test_routed_experts_are_the_reference_routers_top_k_per_position(client, reference):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4)
    request = GenerationRequest(
        prompt_ids=PROMPTS[1], n=1, sampling=sampling, group_id=0, return_routed_experts=True
    )
    [[sample]] = client.generate([request])
    ids = PROMPTS[1] + sample.response_ids
    routes = sample.routed_experts
    assert routes.shape == (len(ids) - 1, NUM_LAYERS, TOP_K)
    with torch.no_grad():
        out = reference(torch.tensor([ids[:-1]]), output_router_logits=True)
    for layer, router_logits in enumerate(out.router_logits):
        expected = router_logits.reshape(len(ids) - 1, -1).topk(TOP_K, dim=-1).indices
        assert np.array_equal(np.sort(routes[:, layer], -1), np.sort(expected.numpy(), -1)), layer


def test_update_weights_from_disk_and_its_error_reply(client, model_dir, reference, tmp_path):
    """The checkpoint DiskSync writes (write_hf_checkpoint: no torch_dtype in config.json) loads, and the server
    then scores with the new weights; a bad path is refused with success=false. The original weights come back."""
    other = save_demo_model(tmp_path / "seed1", seed=1)
    new_model = type(reference).from_pretrained(other, dtype=torch.float32).eval()
    arch = QwenArch.from_hf_dict(DEMO_MODEL)
    state = safetensors.torch.load_file(other / "model.safetensors")  # the per-expert layout on disk
    export = write_hf_checkpoint(
        ((name, state[name]) for name in hf_expected_shapes(arch)),
        tmp_path / "export",
        arch,
        dtype=torch.float32,
        tokenizer=CharTokenizer(),
    )
    ids = PROMPTS[0] + [30, 31, 32]
    try:
        client.update_weights_from_disk(str(export))
        [values] = client.score([ids], len(PROMPTS[0]))
        assert np.allclose(
            values, reference_logp(new_model, ids)[len(PROMPTS[0]) - 1 :].numpy(), atol=FP32_TOL
        )
        # SGLang answers HTTP 400 {"success": false, "message": ...}: refused, not retried
        with pytest.raises(RolloutError, match="HTTP 400 from /update_weights_from_disk"):
            client.update_weights_from_disk(str(tmp_path / "missing"))
    finally:
        client.update_weights_from_disk(str(model_dir))
    [values] = client.score([ids], len(PROMPTS[0]))
    assert np.allclose(values, reference_logp(reference, ids)[len(PROMPTS[0]) - 1 :].numpy(), atol=FP32_TOL)


def test_update_weights_from_tensor_from_another_process(client, model_dir, reference, tmp_path):
    """The tensor sync against real SGLang on CPU: the trainer is not a multiprocessing child of the server, so
    the client sends named shared-memory handles (file_system; SGLang's scheduler dies of a file-descriptor one it
    may not fetch). Two buckets, then end_weight_update; the server scores with the new weights, and a second
    sync puts the original ones back."""
    other = save_demo_model(tmp_path / "seed2", seed=2)
    new_model = type(reference).from_pretrained(other, dtype=torch.float32).eval()
    ids = PROMPTS[1] + [30, 31, 32]

    def push(model_path: Path) -> None:
        named = list(safetensors.torch.load_file(model_path / "model.safetensors").items())
        half = len(named) // 2
        client.update_weights_from_tensors(named[:half])
        client.update_weights_from_tensors(named[half:])
        client.finish_weight_update(flush_cache=True)

    try:
        push(other)
        [values] = client.score([ids], len(PROMPTS[1]))
        assert np.allclose(
            values, reference_logp(new_model, ids)[len(PROMPTS[1]) - 1 :].numpy(), atol=FP32_TOL
        )
    finally:
        push(model_dir)
    [values] = client.score([ids], len(PROMPTS[1]))
    assert np.allclose(values, reference_logp(reference, ids)[len(PROMPTS[1]) - 1 :].numpy(), atol=FP32_TOL)


def test_housekeeping_endpoints_api_key_and_errors(client, sglang_url, model_dir):
    assert client.health()
    client.flush_cache()
    get = lambda path, **kw: httpx.get(sglang_url + path, timeout=30, **kw)  # noqa: E731
    assert get("/health").status_code == 200  # open without the key (the client's startup probe relies on it)
    info = get("/get_model_info", headers=_auth()).json()
    assert info["model_path"] == str(model_dir) and info["tokenizer_path"] == str(model_dir)
    server = get("/get_server_info", headers=_auth()).json()
    assert server["dtype"] == "float32" and server["enable_return_routed_experts"] is True
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 1}}
    assert httpx.post(sglang_url + "/generate", json=body, timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.post(sglang_url + "/generate", json=body, headers=wrong, timeout=30).status_code == 401


def test_bf16_server_scores_like_transformers_in_bf16(sglang_bf16_url, reference):
    """Served in bfloat16 (SGLang's --dtype bfloat16), scoring stays within bf16 rounding of transformers' bf16
    forward, and /get_server_info says bfloat16 (what the client's precision check reads)."""
    from sapo_megatron.rollout.sglang.client import SGLangClient
    from sapo_megatron.rollout.sglang.topology import served_precision

    client = SGLangClient([sglang_bf16_url], timeout_s=120.0, max_retries=0)
    try:
        sequences = [PROMPTS[0] + [30, 31, 32], PROMPTS[1] + [40, 41]]
        starts = [len(PROMPTS[0]), len(PROMPTS[1])]
        scores = client.score(sequences, starts)
    finally:
        client.close()
    bf16 = copy.deepcopy(reference).to(torch.bfloat16)
    for ids, start, values in zip(sequences, starts, scores):
        expected = reference_logp(bf16, ids)[start - 1 :].numpy()
        exact = reference_logp(reference, ids)[start - 1 :].numpy()
        assert np.abs(np.array(values) - expected).max() < BF16_TOL, (values, expected)
        assert np.abs(np.array(values) - exact).max() < BF16_TOL
    info = httpx.get(sglang_bf16_url + "/get_server_info", timeout=30).json()
    assert served_precision(info) == "bf16"


BAD_REQUESTS = {
    "negative temperature": {
        "input_ids": [1, 5],
        "sampling_params": {"max_new_tokens": 2, "temperature": -1},
    },
    "top_p 0": {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2, "top_p": 0}},
    "longer than the context": {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 200}},
    "empty input_ids": {"input_ids": [], "sampling_params": {"max_new_tokens": 2}},
}


@pytest.mark.parametrize("server", ["sglang", "stand-in"])
def test_error_replies_are_http_400_with_a_message(server, sglang_url, standin_url):
    """The stand-in refuses what SGLang refuses, with the same status and body shape (``{"error": {"message"}}``);
    SGLang's messages are kept as measured in the ids. An out-of-vocabulary token id is not sent: it kills real
    SGLang's scheduler (IndexError in the embedding, the whole server exits) – see docs/cluster.md."""
    url = sglang_url if server == "sglang" else standin_url
    for case, body in BAD_REQUESTS.items():
        reply = httpx.post(url + "/generate", json=body, headers=_auth(), timeout=30)
        assert reply.status_code == 400, (case, reply.status_code, reply.text)
        assert reply.json()["error"]["message"], case
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}
