"""Colocation against the real SGLang 0.5.23 on CPU: release → resume (weights) → tensor sync → resume (KV cache)
→ generate, with the client's state machine in front, and ``/weights_checker``'s ``checksum`` against the
trainer's export. Without ``--enable-memory-saver`` release and resume are SGLang's control flow only (its no-op
adapter), which is what runs on a CPU."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import safetensors.torch
import torch

from sapo_megatron.rollout.sglang.memory import MemoryStateError
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams
from sapo_megatron.rollout.weight_checksum import expected_checksums, mismatches
from tests.servers import save_demo_model
from tests.sglang_real.conftest import API_KEY
from tests.sglang_real.test_conformance import FP32_TOL, PROMPTS, reference_logp


def _checkpoint(path: Path) -> list[tuple[str, torch.Tensor]]:
    return sorted(safetensors.torch.load_file(path / "model.safetensors").items())


def _push(client, named) -> None:
    half = len(named) // 2
    client.update_weights_from_tensors(named[:half])
    client.update_weights_from_tensors(named[half:])
    client.finish_weight_update(flush_cache=False)  # the KV cache is still released: flush after its resume


def test_release_resume_sync_generate_and_checksum(client, sglang_url, model_dir, reference, tmp_path):
    other = save_demo_model(tmp_path / "seed3", seed=3)
    new_model = type(reference).from_pretrained(other, dtype=torch.float32).eval()
    ids = PROMPTS[0] + [30, 31, 32]
    start = len(PROMPTS[0])
    assert not mismatches(expected_checksums(_checkpoint(model_dir)), client.weight_checksums()[sglang_url])

    client.release_memory()  # all three tags; SGLang answered 200 null
    try:
        with pytest.raises(MemoryStateError, match="generate needs memory"):
            client.generate(
                [
                    GenerationRequest(
                        group_id=0, prompt_ids=PROMPTS[0], sampling=SamplingParams(max_new_tokens=2), n=1
                    )
                ]
            )
        client.resume_memory(["weights"])
        with pytest.raises(MemoryStateError, match="KeyError"):
            client.resume_memory(["weights"])  # would kill the server: refused before it is sent
        _push(client, _checkpoint(other))
        client.resume_memory(["kv_cache", "cuda_graph"])
    finally:
        for tags in client.released_memory()[sglang_url]:
            client.resume_memory([tags])
    client.flush_cache()
    [values] = client.score([ids], start)
    np.testing.assert_allclose(values, reference_logp(new_model, ids)[start - 1 :].numpy(), atol=FP32_TOL)
    served = client.weight_checksums()[sglang_url]
    assert not mismatches(expected_checksums(_checkpoint(other)), served)
    assert mismatches(expected_checksums(_checkpoint(model_dir)), served)  # the check sees a change

    client.release_memory(["weights"])  # back to the tier's weights, as flattened buckets (colocate's sync)
    client.resume_memory(["weights"])
    client.control.flatten_buckets = True
    try:
        _push(client, _checkpoint(model_dir))
    finally:
        client.control.flatten_buckets = False
    client.flush_cache()
    [values] = client.score([ids], start)
    np.testing.assert_allclose(values, reference_logp(reference, ids)[start - 1 :].numpy(), atol=FP32_TOL)
    assert not mismatches(expected_checksums(_checkpoint(model_dir)), client.weight_checksums()[sglang_url])


def test_raw_replies_are_200_null(sglang_url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=sglang_url, headers=headers, timeout=60) as http:
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            reply = http.post(path, json={"tags": ["cuda_graph"]})
            assert reply.status_code == 200 and reply.json() is None
        reply = http.post("/weights_checker", json={"action": "no_such_action"})
        assert reply.status_code == 400 and reply.json()["success"] is False
