"""HF export of the live (TP/PP/EP-sharded) Megatron model: buckets of full HF-named tensors, and whole HF
checkpoints written with the same streaming writer as offline conversion."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from sapo_megatron.checkpoint import atomic, fused_experts
from sapo_megatron.checkpoint.mapping import hf_expected_shapes
from sapo_megatron.checkpoint.safetensors_stream import TensorSpec, plan_shards, write_index, write_shard
from sapo_megatron.model.arch import QwenArch

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 1024**2
DEFAULT_SHARD_BYTES = 5 * 1024**3

Bucket = list[tuple[str, torch.Tensor]]


def hf_buckets(
    module: torch.nn.Module,
    arch: QwenArch,
    bucket_bytes: int,
    *,
    per_stage: bool = False,
    include_frozen: bool = False,
) -> Iterator[Bucket]:
    """Full HF-named tensors in buckets: of the whole model on the main rank, or (``per_stage``) of each
    pipeline stage on that stage's source rank. Every rank must exhaust the iterator (it takes part in the
    gathers and transfers); ranks that receive nothing get empty buckets. A frozen vision tower is left out
    unless ``include_frozen`` (the engine keeps the one it loaded)."""
    from sapo_megatron.megatron.weights import iter_hf_buckets

    yield from iter_hf_buckets(
        module, arch, bucket_bytes=bucket_bytes, dst=0, per_stage=per_stage, include_frozen=include_frozen
    )


def bucket_bytes_of(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def export_hf(
    module: torch.nn.Module, arch: QwenArch, out_dir: str | Path, *, tokenizer=None, is_main: bool
) -> Path:
    """Collective: write the whole (sharded) model as an HF checkpoint on the main rank; the other ranks take
    part in gathering the weights."""
    buckets = hf_buckets(module, arch, DEFAULT_BUCKET_BYTES, include_frozen=True)  # a whole checkpoint
    tensors = (item for bucket in buckets for item in bucket)
    if is_main:
        dtype = next(module.parameters()).dtype
        return write_hf_checkpoint(tensors, out_dir, arch, dtype=dtype, tokenizer=tokenizer)
    for _ in tensors:
        pass
    return Path(out_dir)


def hf_config_with_tokens(arch: QwenArch, tokenizer=None) -> dict:
    """``arch``'s ``config.json`` with the special token ids it leaves unset taken from the tokenizer: without
    ``eos_token_id`` transformers' ``generate`` and SGLang never stop a response."""
    config = arch.to_hf_dict()
    if tokenizer is not None:
        for key, value in (("eos_token_id", tokenizer.eos_id), ("pad_token_id", tokenizer.pad_id)):
            if config.get(key) is None and value is not None:
                config[key] = value
    if config.get("eos_token_id") is None:
        logger.warning(
            "the exported config.json has no eos_token_id: generation will not stop at an end token"
        )
    return config


def write_hf_checkpoint(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    arch: QwenArch,
    *,
    dtype: torch.dtype,
    tokenizer=None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write an HF checkpoint (safetensors shards [+ index] + config.json [+ tokenizer]) from tensors arriving
    in :func:`~sapo_megatron.checkpoint.mapping.hf_expected_shapes` order, streaming one tensor at a time (the
    same writer as offline conversion), into a temporary sibling that replaces ``out_dir`` once complete."""
    out_dir = Path(out_dir)
    shapes = list(hf_expected_shapes(arch).items())
    groups = fused_experts.fused_groups(dict(shapes)) if arch.is_vl else []
    if groups:  # Qwen3-VL-MoE: experts fused in the hub layout, as transformers and SGLang load them
        shapes = fused_experts.fuse_specs(shapes)
    specs = [TensorSpec(name, shape, dtype) for name, shape in shapes]
    shards = plan_shards(specs, shard_bytes)
    tmp = atomic.prepare_output_dir(out_dir, force=True)
    stream = fused_experts.fuse_stream(((name, tensor.to(dtype)) for name, tensor in tensors), groups)
    for shard in shards:
        write_shard(tmp / shard.filename, shard, stream)
    write_index(tmp, shards)
    (tmp / "config.json").write_text(json.dumps(hf_config_with_tokens(arch, tokenizer), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(tmp)
        _copy_processor(getattr(tokenizer, "directory", None), tmp)
    atomic.fsync_path(tmp)
    atomic.publish(tmp, out_dir, replace=True)
    return out_dir


PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


def _copy_processor(source: Path | None, out_dir: Path) -> None:
    """A VL model's image / video processor files, from the tokenizer's directory (the engine that loads the
    export builds the same image processor the trainer's renderer used)."""
    for name in PROCESSOR_FILES:
        if source is not None and (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, out_dir / name)
