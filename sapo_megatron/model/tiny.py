"""Tiny Qwen3 / Qwen3-MoE models made by code (no downloads): for tests, benchmarks, the GPU check and the
embedded demo. Random weights come from HF transformers' own initialisation under a fixed seed."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from sapo_megatron.model.arch import QwenArch

Kind = Literal["moe", "dense"]


def tiny_hf_config(kind: Kind = "moe", **overrides: Any) -> dict[str, Any]:
    """An HF ``config.json`` dict for a tiny model: 2 layers, hidden 32, 4 query / 2 KV heads, 8 experts top-2."""
    base: dict[str, Any] = {
        "model_type": "qwen3_moe" if kind == "moe" else "qwen3",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    if kind == "moe":
        base.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
    base.update(overrides)
    return QwenArch.from_hf_dict(base).to_hf_dict()


def build_hf_model(hf_config: dict[str, Any], *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """An HF ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` with seeded random weights."""
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config)
    torch.manual_seed(seed)
    model_cls = (
        transformers.Qwen3MoeForCausalLM
        if hf_config["model_type"] == "qwen3_moe"
        else transformers.Qwen3ForCausalLM
    )
    return model_cls(config).to(dtype).eval()


def make_tiny_hf_checkpoint(
    out_dir: str | Path,
    kind: Kind = "moe",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Write a tiny random HF checkpoint (config.json + safetensors) and return its directory."""
    out_dir = Path(out_dir)
    model = build_hf_model(tiny_hf_config(kind, **overrides), seed=seed, dtype=dtype)
    model.save_pretrained(out_dir)
    return out_dir
