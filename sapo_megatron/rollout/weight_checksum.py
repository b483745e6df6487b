"""Checksums of served weights against the trainer's export (SGLang's ``/weights_checker`` ``checksum`` action).

SGLang 0.5.23 (``srt/utils/weight_checker.py``, ``_compute_checksum``): per parameter of the served model,
``f"{tensor_hash(t):016x}"``, where ``tensor_hash`` of a CPU tensor is the first 8 bytes of the SHA-256 of its raw
bytes read big-endian (``srt/managers/mm_utils.py``; CUDA tensors use a triton hash instead, so the values match
the trainer's only for servers on CPU). The reply is ``{"success", "message", "ranks": [{"checksums": {name: hex},
"per_gpu_checksum", "parallelism_info": [...]}], "per_engine_checksum"}``, one rank entry per TP rank.

The served parameters are not the HF checkpoint's tensors: SGLang fuses and pads them. :func:`served_layout` gives
the served tensors of a Qwen3 / Qwen3-MoE checkpoint on a TP-1 server, measured against real SGLang 0.5.23 on CPU
(tests/sglang_real/test_memory.py): ``self_attn.qkv_proj`` = cat(q, k, v); ``mlp.gate_up_proj`` = cat(gate, up);
``mlp.experts.w13_weight`` [E, 2F, H] = per expert cat(gate, up); ``mlp.experts.w2_weight`` [E, H, F] = per expert
down; ``embed_tokens`` and ``lm_head`` padded with zero rows to a multiple of 64 (``DEFAULT_VOCAB_PADDING_SIZE``);
every other name as in the checkpoint. The CPU stand-in reports the same names and values.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping

import torch

VOCAB_PADDING = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE (layers/vocab_parallel_embedding.py)
_EXPERT = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
_FUSED = {  # served name suffix: the checkpoint suffixes concatenated along dim 0
    "self_attn.qkv_proj.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's checksum of one CPU tensor (``_hash_tensor``)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    # numpy's stubs declare ndarray's buffer protocol (__buffer__) for Python >= 3.12 only
    return hashlib.sha256(memoryview(data.numpy())).digest()[:8].hex()  # type: ignore[arg-type]


def served_layout(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a TP-1 SGLang server holds for these HF-named ones (see the module docstring). Accepts
    per-expert checkpoint names and transformers' fused in-memory experts (``experts.gate_up_proj`` [E, 2F, H],
    ``experts.down_proj`` [E, H, F]), which already are SGLang's ``w13_weight`` / ``w2_weight``."""
    served: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    fused_parts = {part for parts in _FUSED.values() for part in parts}
    for name, tensor in named.items():
        match = _EXPERT.match(name)
        if match:
            experts.setdefault(match["prefix"], {}).setdefault(int(match["expert"]), {})[match["proj"]] = (
                tensor
            )
        elif name.endswith(".mlp.experts.gate_up_proj"):
            served[name.removesuffix("gate_up_proj") + "w13_weight"] = tensor
        elif name.endswith(".mlp.experts.down_proj"):
            served[name.removesuffix("down_proj") + "w2_weight"] = tensor
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            served[name] = _pad_rows(tensor, VOCAB_PADDING)
        elif not any(name.endswith("." + part) for part in fused_parts):
            served[name] = tensor
    for fused, parts in _FUSED.items():
        for name in named:
            if name.endswith("." + parts[0]):
                prefix = name.removesuffix(parts[0])
                served[prefix + fused] = torch.cat([named[prefix + p] for p in parts])
    for prefix, by_expert in experts.items():
        order = [by_expert[e] for e in sorted(by_expert)]
        served[prefix + ".w13_weight"] = torch.stack(
            [torch.cat([x["gate_proj"], x["up_proj"]]) for x in order]
        )
        served[prefix + ".w2_weight"] = torch.stack([x["down_proj"] for x in order])
    return served


def expected_checksums(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> dict[str, str]:
    """Per served name, the checksum a TP-1 server holding these weights reports (``dtype``: the served dtype;
    SGLang's load casts as ``Tensor.to`` does)."""
    tensors = {name: t if dtype is None else t.to(dtype) for name, t in named}
    return {name: tensor_checksum(t) for name, t in served_layout(tensors).items()}


def mismatches(expected: Mapping[str, str], served: Mapping[str, str]) -> list[str]:
    """The served names whose checksum differs or is missing on either side, sorted."""
    return sorted(n for n in set(expected) | set(served) if expected.get(n) != served.get(n))


def _pad_rows(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    rows = -(-tensor.shape[0] // multiple) * multiple
    if rows == tensor.shape[0]:
        return tensor
    padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype)
    padded[: tensor.shape[0]] = tensor
    return padded


class ChecksumStream:
    """Expected checksums of a weight sync, computed from its buckets as they are sent, one layer held at a time.

    Tensors must arrive in the export's order (``hf_expected_shapes``: a layer's tensors together, as
    ``hf_buckets`` yields them); they are cast to the served ``dtype`` and copied, hashed once their layer is
    complete, then dropped."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.checksums: dict[str, str] = {}
        self._group: str | None = None
        self._pending: dict[str, torch.Tensor] = {}

    def add(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            group = _layer_of(name)
            if group != self._group:
                self._flush()
                self._group = group
            self._pending[name] = tensor.detach().to("cpu", self.dtype, copy=True)

    def finish(self) -> dict[str, str]:
        self._flush()
        return self.checksums

    def _flush(self) -> None:
        if self._pending:
            self.checksums.update({n: tensor_checksum(t) for n, t in served_layout(self._pending).items()})
        self._pending = {}


def _layer_of(name: str) -> str:
    match = re.match(r"^(.*\.layers\.\d+)\.", name)
    return match.group(1) if match else name
