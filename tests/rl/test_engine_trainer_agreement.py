"""The CPU rollout engine, reached over SGLang's HTTP protocol, and the Megatron trainer agree at the same
weights: per-token log-probs and MoE routes."""

from __future__ import annotations

import pytest

from sapo_megatron.model.tiny import make_tiny_hf_checkpoint
from tests.distributed import run_distributed

LOGP_TOLERANCE = 1e-4  # fp32; transformers and Megatron sum in different orders
MIN_ROUTING_AGREEMENT = 0.95


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    hf_dir = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "moe", "moe", seed=5)
    (out,) = run_distributed("tests.rl.scenarios:engine_vs_trainer", 1, {"hf_dir": str(hf_dir)})
    print(f"engine vs trainer: {out}")
    return out


def test_logprobs_agree(result):
    assert result["tokens"] > 40
    assert result["max_abs_delta"] <= LOGP_TOLERANCE


def test_routed_experts_shape_and_agreement(result):
    for shape, length in zip(result["route_shapes"], result["lengths"]):
        assert shape == (length - 1, 2, 2)  # [prompt + response - 1, layers, top_k]
    assert result["routing_agreement"] >= MIN_ROUTING_AGREEMENT
