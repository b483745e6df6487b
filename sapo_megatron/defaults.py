"""The embedded default run: a tiny Qwen3-MoE trained on CPU from nothing, no downloads.

A short supervised warm start teaches the format of two-digit addition (``"12+34="`` → ``"46"``), then SAPO
RL against the in-process CPU rollout engine raises held-out accuracy. ``sapo-megatron train`` with no config
runs this; ``configs/demo_tiny_moe_cpu.yaml`` is the same run as a file to copy and edit.
"""

from __future__ import annotations

import copy
from typing import Any

from sapo_megatron.data.tokenizer import CharTokenizer

TOKENIZER = CharTokenizer()

DEMO_MODEL: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": TOKENIZER.vocab_size,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "bos_token_id": TOKENIZER.bos_id,
    "eos_token_id": TOKENIZER.eos_id,
    "pad_token_id": TOKENIZER.pad_id,
}

AUTO_SIZED = ("vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")

DEMO_RUN: dict[str, Any] = {
    "name": "demo-tiny-moe-sapo",
    "output_dir": "runs/demo",
    "seed": 1234,
    # The sizes that follow the data (sapo_megatron/data/sizing.py): with the char tokenizer and two-digit
    # addition they are DEMO_MODEL's (52 tokens, context 64, ids 1 / 2 / 0); with data.tokenizer: chat and a
    # message dataset, the vocabulary and context of those.
    "model": {"hf_config": {**DEMO_MODEL, **dict.fromkeys(AUTO_SIZED, "auto")}, "init_std": 0.02},  # = tiny
    "launch": {"cpu_threads": 1},
    # RL on this tiny model is stable at 5e-5 and collapses at 3e-4 (measured): RL wants a far smaller rate
    # than the supervised warm start.
    "optimizer": {"lr": 5e-5, "weight_decay": 0.0, "clip_grad": 1.0, "adam_beta2": 0.98},
    "sft": {"steps": 400, "global_batch": 64, "lr": 3e-4, "log_every": 10},
    "rollout": {
        "engine": "cpu",
        "n_samples": 8,
        "temperature": 0.7,
        "max_new_tokens": 6,
        "weight_sync": "tensor",
        "threads": 1,
    },
    "data": {
        "train": "synthetic:addition",
        "tokenizer": "char",
        "digits": 2,
    },
    "algorithm": {"loss": {"name": "sapo", "tau_pos": 1.0, "tau_neg": 1.05}, "reward": "numeric_match"},
    "trainer": {"steps": 500, "prompts_per_step": 32, "mini_batches": 2, "save_every": 100},
    # Held-out accuracy: greedy (n 1, temperature 0) on 200 held-out addition problems, every 50 steps.
    "eval": {"every": 50, "datasets": [{"name": "heldout", "path": "synthetic:addition", "size": 200}]},
}


def tiny_model() -> dict[str, Any]:
    """What ``model.hf_config: tiny`` stands for: the demo's architecture, its sizes ``auto``."""
    return {**DEMO_MODEL, **dict.fromkeys(AUTO_SIZED, "auto")}


DEMO_VL_MODEL: dict[str, Any] = {
    "model_type": "qwen3_vl_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    },
    "vision_config": {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "patch_size": 8,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1, 2],
    },
}
"""The CPU VL demo's tiny Qwen3-VL-MoE (``configs/demo_tiny_vl_moe_cpu.yaml``) without the sizes that follow the
data: ``model.hf_config: tiny_vl`` takes the image token ids, the vocabulary and the end-of-text id from the
tokenizer and the context from the prompts (:func:`sapo_megatron.config.load.fill_auto_sizes`)."""


def embedded_default_dict() -> dict[str, Any]:
    """A fresh copy of the embedded default run config."""
    return copy.deepcopy(DEMO_RUN)
