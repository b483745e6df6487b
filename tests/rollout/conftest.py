"""Tiny random Qwen3 / Qwen3-MoE checkpoints and reference computations for the rollout tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from sapo_megatron.rollout.cpu.engine import CPUEngine

VOCAB = 64
NUM_LAYERS = 2
TOP_K = 2


def make_moe_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=256,
    )
    return transformers.Qwen3MoeForCausalLM(config).eval()


def make_dense_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    return transformers.Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """Tiny models run as fast on one thread, and one thread stays fast when other processes load the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def engine_from(path, **kwargs) -> CPUEngine:
    return CPUEngine.from_pretrained(path, num_threads=1, **kwargs)


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe_a")
    make_moe_model(0).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def moe_dir_b(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe_b")
    make_moe_model(1).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense")
    make_dense_model(2).save_pretrained(path)
    return path


def load(path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reference_logprobs(
    model: torch.nn.Module, token_ids: list[int], start: int, temperature: float = 1.0
) -> np.ndarray:
    """log_softmax(logits / T) of token t given ids[:t], for t >= start: one plain forward, no cache, no padding."""
    ids = torch.tensor([token_ids])
    logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None]).squeeze(1)
    return logp[start - 1 :].numpy()


@torch.no_grad()
def reference_routing(model: torch.nn.Module, token_ids: list[int]) -> np.ndarray:
    """Sorted router top-k per token and layer of one plain forward: [len - 1, layers, top_k]."""
    captured = {}
    handles = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out, i=i: captured.__setitem__(i, out[2]))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        model(input_ids=torch.tensor([token_ids]))
    finally:
        for handle in handles:
            handle.remove()
    routed = np.stack([captured[i].numpy() for i in range(len(model.model.layers))], axis=1)
    return np.sort(routed[:-1], axis=-1)
