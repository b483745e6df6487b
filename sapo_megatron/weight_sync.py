"""Trainer → rollout engine weight sync, and HF export of the live model.

Every rank takes part (tensor-parallel gathers and the cross-stage / cross-expert-rank transfer are
collectives); the main rank receives full HF-named tensors in size-bounded buckets and pushes them to the engine:
``tensor`` mode hands them over directly (``update_weights_from_tensors``), ``disk`` mode writes an HF checkpoint
to a staging directory (atomically) and asks the engine to load it (``update_weights_from_disk``).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from sapo_megatron.arch import QwenArch
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
        return write_hf_checkpoint(tensors, out_dir, arch, tokenizer=tokenizer)
    for _ in tensors:
        pass
    return Path(out_dir)


def write_hf_checkpoint(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    arch: QwenArch,
    *,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write an HF checkpoint (safetensors shards + index + config.json [+ tokenizer]) atomically: into a
    temporary sibling directory, renamed over ``out_dir`` at the end."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_size, files = 0, []
    for name, tensor in tensors:
        tensor = tensor.detach().to(dtype or tensor.dtype).contiguous().cpu()
        if shard and shard_size + tensor.numel() * tensor.element_size() > shard_bytes:
            files.append(_flush_shard(tmp, shard, len(files), weight_map))
            shard, shard_size = {}, 0
        shard[name] = tensor
        shard_size += tensor.numel() * tensor.element_size()
    if shard:
        files.append(_flush_shard(tmp, shard, len(files), weight_map))
    _rename_shards(tmp, files, weight_map)
    (tmp / "config.json").write_text(json.dumps(arch.to_hf_dict(), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def _flush_shard(
    directory: Path, shard: dict[str, torch.Tensor], index: int, weight_map: dict[str, str]
) -> str:
    name = f"shard-{index:05d}.safetensors"
    save_file(shard, str(directory / name), metadata={"format": "pt"})
    weight_map.update({tensor_name: name for tensor_name in shard})
    return name


def _rename_shards(directory: Path, files: list[str], weight_map: dict[str, str]) -> None:
    """HF naming: ``model.safetensors`` for one shard, else ``model-0000i-of-0000n.safetensors`` + index."""
    if len(files) == 1:
        (directory / files[0]).rename(directory / "model.safetensors")
        return
    final = {old: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, old in enumerate(files)}
    for old, new in final.items():
        (directory / old).rename(directory / new)
    index = {"metadata": {}, "weight_map": {name: final[file] for name, file in sorted(weight_map.items())}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


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
