"""Trainer → rollout engine weight sync, and HF export of the live model.

Every rank takes part (tensor-parallel gathers and the cross-stage / cross-expert-rank transfer are
collectives); the main rank receives full HF-named tensors in size-bounded buckets and pushes them to the engine:
``tensor`` mode hands them over directly (``update_weights_from_tensors``), ``disk`` mode writes an HF checkpoint
to a staging directory (atomically) and asks the engine to load it (``update_weights_from_disk``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from sapo_megatron.arch import QwenArch
from sapo_megatron.checkpoint import atomic
from sapo_megatron.checkpoint.mapping import hf_expected_shapes
from sapo_megatron.checkpoint.safetensors_stream import TensorSpec, plan_shards, write_index, write_shard
from sapo_megatron.rollout.base import RolloutEngine

DEFAULT_BUCKET_BYTES = 512 * 1024**2
DEFAULT_SHARD_BYTES = 5 * 1024**3


def hf_buckets(
    module: torch.nn.Module, arch: QwenArch, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full HF-named tensors of the whole model, in buckets, on the main rank (others iterate to take part)."""
    from sapo_megatron.megatron.weights import iter_hf_buckets

    yield from iter_hf_buckets(module, arch, bucket_bytes=bucket_bytes, dst=0)


def export_hf(
    module: torch.nn.Module, arch: QwenArch, out_dir: str | Path, *, tokenizer=None, is_main: bool
) -> Path:
    """Collective: write the whole (sharded) model as an HF checkpoint on the main rank; the other ranks take
    part in gathering the weights."""
    tensors = (item for bucket in hf_buckets(module, arch, DEFAULT_BUCKET_BYTES) for item in bucket)
    if is_main:
        dtype = next(module.parameters()).dtype
        return write_hf_checkpoint(tensors, out_dir, arch, dtype=dtype, tokenizer=tokenizer)
    for _ in tensors:
        pass
    return Path(out_dir)


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
    specs = [TensorSpec(name, shape, dtype) for name, shape in hf_expected_shapes(arch).items()]
    shards = plan_shards(specs, shard_bytes)
    tmp = atomic.prepare_output_dir(out_dir, force=True)
    stream = ((name, tensor.to(dtype)) for name, tensor in tensors)
    for shard in shards:
        write_shard(tmp / shard.filename, shard, stream)
    write_index(tmp, shards)
    (tmp / "config.json").write_text(json.dumps(arch.to_hf_dict(), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(tmp)
    atomic.fsync_path(tmp)
    atomic.publish(tmp, out_dir, replace=True)
    return out_dir


class WeightSync:
    """Pushes the trainer's weights to a rollout engine (the engine lives on the main rank only)."""

    def __init__(
        self,
        engine: RolloutEngine | None,
        arch: QwenArch,
        *,
        mode: str,
        staging_dir: str | Path,
        tokenizer=None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.engine, self.arch, self.mode = engine, arch, mode
        self.staging_dir = Path(staging_dir)
        self.tokenizer = tokenizer
        self.bucket_bytes = bucket_bytes

    def push(self, module: torch.nn.Module) -> dict[str, float]:
        """Collective: call on every rank. Returns timing metrics (main rank)."""
        start = time.perf_counter()
        is_main = self.engine is not None
        if self.mode == "disk":
            path = export_hf(module, self.arch, self.staging_dir, tokenizer=self.tokenizer, is_main=is_main)
            if is_main:
                self.engine.update_weights_from_disk(str(path))
        else:
            tensors = (item for bucket in hf_buckets(module, self.arch, self.bucket_bytes) for item in bucket)
            if is_main:
                self.engine.update_weights_from_tensors(tensors)
            else:
                for _ in tensors:  # take part in the gathers
                    pass
        return {"time/weight_sync_s": time.perf_counter() - start} if is_main else {}
