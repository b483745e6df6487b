"""Tiny Qwen3 / Qwen3-MoE / Qwen3-VL-MoE models made by code (no downloads): for tests, benchmarks, the GPU
check and the embedded demo. Random weights come from HF transformers' own initialisation under a fixed seed;
synthetic images (seeded noise) go through transformers' own image processor."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from sapo_megatron.model.arch import QwenArch

Kind = Literal["moe", "dense", "vl_moe", "vl_dense"]

TINY_VL_TOKENS = {
    "vision_start_token_id": 248,
    "vision_end_token_id": 249,
    "image_token_id": 250,
    "video_token_id": 251,
}
"""Special token ids of the tiny VL model (vocabulary 256; the real model's are 151652..151656)."""


def tiny_hf_config(kind: Kind = "moe", **overrides: Any) -> dict[str, Any]:
    """An HF ``config.json`` dict for a tiny model: 2 layers, hidden 32, 4 query / 2 KV heads, 8 experts top-2
    (``vl_moe``: :func:`tiny_vl_hf_config`)."""
    if kind in ("vl_moe", "vl_dense"):
        return tiny_vl_hf_config(moe=kind == "vl_moe", **overrides)
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


def tiny_vl_hf_config(
    *, moe: bool = True, text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A tiny Qwen3-VL-MoE: ViT depth 3 (hidden 32, patch 8, merge 2, DeepStack after every block) and an LM of
    3 MoE layers (hidden 32, head_dim 16 so that the interleaved MRoPE sections [4, 2, 2] differ from the
    chunked layout, 4 experts top-2, expert FFN 24 so that H=32, I=24 and 2I=48 all differ); ``moe=False``: the
    dense Qwen3-VL with the same tower and a dense LM (FFN 64)."""
    text_config: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        **(
            {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": True}
            if moe
            else {}
        ),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
        **(text or {}),
    }
    vision_config: dict[str, Any] = {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "patch_size": 8,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": text_config["hidden_size"],
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1, 2],
        **(vision or {}),
    }
    raw = {
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
        "text_config": text_config,
        "vision_config": vision_config,
        "tie_word_embeddings": False,
        **TINY_VL_TOKENS,
    }
    return QwenArch.from_hf_dict(raw).to_hf_dict()


def build_hf_model(hf_config: dict[str, Any], *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """An HF ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``Qwen3VLMoeForConditionalGeneration`` with seeded
    random weights."""
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config)
    torch.manual_seed(seed)
    model_cls = {
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
    }[hf_config["model_type"]]
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


def synthetic_images(sizes: list[tuple[int, int]], *, seed: int = 0) -> list:
    """Seeded noise RGB images (PIL), one per ``(height, width)``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def image_processor(arch: QwenArch):
    """transformers' Qwen2-VL image processor (PIL backend: no torchvision) set up for ``arch``'s vision tower
    (patch, temporal patch, merge size; Qwen3-VL's mean = std = 0.5), for images up to 64×64 pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = arch.vl.vision
    unit = vision.patch_size * vision.spatial_merge_size
    return Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        min_pixels=unit * unit,
        max_pixels=64 * 64,
    )


def vl_batch(
    arch: QwenArch, rows: list[list[int | tuple[int, int]]], *, seed: int = 0, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """A right-padded batch of text + image rows, as transformers' processor would give it.

    Each row is a list of items: an ``int`` n is n random text tokens, a ``(height, width)`` an image (seeded
    noise) rendered as ``<vision_start> <image_pad> × (grid.prod() / merge²) <vision_end>``. Returns
    ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (1 on image pads) [b, s], and, when a row has an
    image, ``pixel_values`` [patches, C·T·P·P] and ``image_grid_thw`` [images, 3] in reading order.
    """
    gen = torch.Generator().manual_seed(seed)
    vl = arch.vl
    text_vocab = min(vl.vision_start_token_id, vl.image_token_id, arch.vocab_size)
    sizes = [item for row in rows for item in row if isinstance(item, tuple)]
    images = (
        image_processor(arch)(images=synthetic_images(sizes, seed=seed), return_tensors="pt") if sizes else {}
    )
    grids = iter(images["image_grid_thw"].tolist()) if sizes else iter(())
    merge = vl.vision.spatial_merge_size**2
    token_rows = []
    for row in rows:
        ids: list[int] = []
        for item in row:
            if isinstance(item, int):
                ids += torch.randint(0, text_vocab, (item,), generator=gen).tolist()
            else:
                t, h, w = next(grids)
                pads = [vl.image_token_id] * (t * h * w // merge)
                ids += [vl.vision_start_token_id, *pads, vl.vision_end_token_id]
        token_rows.append(ids)
    width = max(len(ids) for ids in token_rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(token_rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    out = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "mm_token_type_ids": (input_ids == vl.image_token_id).long(),
    }
    if sizes:
        out["pixel_values"] = images["pixel_values"]
        out["image_grid_thw"] = images["image_grid_thw"]
    return out
