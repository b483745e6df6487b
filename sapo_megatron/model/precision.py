"""FP8 training recipes and GPU types: the facts that config validation, the planner, the trainer's padding and
the model builder share. Pure data and small checks; no megatron, no Transformer Engine import.

Sources (read, not copied): Transformer Engine's ``quantization.py`` (``check_fp8_support``: compute capability
8.9+ for delayed/tensorwise scaling; ``check_fp8_block_scaling_support``: 9.0+; ``check_mxfp8_support``: 10.x
only, "not supported on 12.0+ yet"), TE's ``assert_dim_for_fp8_exec`` (FP8 GEMM operands: rows % 8, columns %
16; the weight-gradient GEMM takes the activations transposed, so the token count must be a multiple of 16) and
``MXFP8Quantizer.is_quantizable`` (both dimensions multiples of the 32-element MX block), and megatron-core's
``fp8_utils.get_fp8_align_size`` (32 for mxfp8, 16 otherwise), the same in 0.16.1 and 0.19.x.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

Fp8RecipeName = Literal["delayed", "tensorwise", "blockwise", "mxfp8"]
GpuTypeName = Literal["a100", "l40s", "h100", "h800", "h20", "h200", "b200", "b300", "gb200", "gb300"]


@dataclass(frozen=True)
class Fp8Recipe:
    """One FP8 scaling recipe as Transformer Engine runs it."""

    name: str
    te_recipe: str  # the transformer_engine.common.recipe class Megatron builds for it
    default_format: Literal["e4m3", "hybrid"]
    token_multiple: int  # tokens of every GEMM must be a multiple of this
    min_capability: tuple[int, int]
    below_capability: tuple[int, int] | None  # first compute capability that cannot run it (None: all newer)
    amax_history: bool  # delayed scaling keeps an amax history; the others scale from the current tensor
    bf16_edge_layers: bool  # Megatron can keep first/last layers in bf16 (not with delayed scaling)


FP8_RECIPES: dict[str, Fp8Recipe] = {
    "delayed": Fp8Recipe("delayed", "DelayedScaling", "hybrid", 16, (8, 9), None, True, False),
    "tensorwise": Fp8Recipe("tensorwise", "Float8CurrentScaling", "hybrid", 16, (8, 9), None, False, True),
    # 1x128 activation / 128x128 weight tiles, all e4m3 (the DeepSeek-V3 scheme).
    "blockwise": Fp8Recipe("blockwise", "Float8BlockScaling", "e4m3", 16, (9, 0), None, False, True),
    # OCP MX: 32-element blocks with e8m0 scales; TE runs it on sm_100/sm_103 only.
    "mxfp8": Fp8Recipe("mxfp8", "MXFP8BlockScaling", "e4m3", 32, (10, 0), (12, 0), False, True),
}


@dataclass(frozen=True)
class GpuType:
    """A GPU model: CUDA compute capability and the memory CUDA reports (GiB, ``total_memory``)."""

    name: str
    capability: tuple[int, int]
    memory_gib: float
    arch: str


GPU_TYPES: dict[str, GpuType] = {
    gpu.name: gpu
    for gpu in (
        GpuType("a100", (8, 0), 79.2, "Ampere"),
        GpuType("l40s", (8, 9), 44.4, "Ada"),
        GpuType("h100", (9, 0), 79.1, "Hopper"),
        GpuType("h800", (9, 0), 79.1, "Hopper"),
        GpuType("h20", (9, 0), 94.5, "Hopper"),
        GpuType("h200", (9, 0), 139.8, "Hopper"),
        GpuType("b200", (10, 0), 178.4, "Blackwell"),
        GpuType("gb200", (10, 0), 184.0, "Blackwell"),
        GpuType("b300", (10, 3), 268.0, "Blackwell Ultra"),
        GpuType("gb300", (10, 3), 268.0, "Blackwell Ultra"),
    )
}


def fp8_capability_problem(recipe: str, capability: tuple[int, int], device: str) -> str | None:
    """Why ``device`` (compute capability ``capability``) cannot run ``recipe``, or None when it can."""
    spec = FP8_RECIPES[recipe]
    cap = f"{capability[0]}.{capability[1]}"
    if capability < spec.min_capability:
        need = f"{spec.min_capability[0]}.{spec.min_capability[1]}"
        if recipe == "mxfp8":
            return (
                f"precision.fp8_recipe=mxfp8 needs Blackwell (compute capability 10.x); {device} has {cap}, which "
                "has no MXFP8 tensor cores: use fp8_recipe tensorwise or blockwise (Hopper), or delayed"
            )
        return f"precision.fp8_recipe={recipe} needs compute capability {need}+; {device} has {cap}"
    if spec.below_capability is not None and capability >= spec.below_capability:
        return (
            f"precision.fp8_recipe={recipe}: Transformer Engine does not run it on compute capability {cap} "
            f"({device}) yet; use fp8_recipe tensorwise or blockwise"
        )
    return None


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def fp8_runtime_problem(recipe: str) -> str | None:
    """What stops FP8 *training* on this machine (Transformer Engine missing, or the GPU cannot run the recipe);
    None when it can run. ``--dry-run`` and ``plan`` never call this: they work without TE."""
    if not have_transformer_engine():
        return (
            "precision.dtype=fp8 trains through Transformer Engine, which is not installed here: install "
            "`sapo-megatron[gpu]` on a CUDA machine (NGC PyTorch containers ship it), or train with "
            "precision.dtype=bf16. `train --dry-run` and `plan` work without it"
        )
    import torch

    if not torch.cuda.is_available():
        return "precision.dtype=fp8 needs a CUDA GPU (Transformer Engine's FP8 kernels); none is visible here"
    capability = torch.cuda.get_device_capability()
    return fp8_capability_problem(recipe, capability, torch.cuda.get_device_name())


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
