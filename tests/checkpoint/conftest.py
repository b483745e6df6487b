"""Tiny HF checkpoints (Qwen3-MoE and Qwen3 dense, fp32 and bf16) and their Megatron conversions, made once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sapo_megatron.conversion.to_megatron import hf_to_megatron
from sapo_megatron.model.tiny import make_tiny_hf_checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KINDS = ("moe-fp32", "moe-bf16", "dense-fp32", "dense-bf16")


def read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory (all shards)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bits."""
    assert set(got) == set(want), f"names differ: {sorted(set(got) ^ set(want))[:10]}"
    bad = [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:5]}"


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for key in KINDS:
        kind, dtype = key.split("-")
        out[key] = make_tiny_hf_checkpoint(root / key, kind, seed=7, dtype=DTYPES[dtype])
    return out


@pytest.fixture(scope="session")
def converted(hf_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """``hf_to_megatron`` of every tiny checkpoint (TP1 reference layout)."""
    root = tmp_path_factory.mktemp("mcore")
    return {key: hf_to_megatron(path, root / key, progress=False) for key, path in hf_checkpoints.items()}
