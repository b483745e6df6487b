"""Write sharded safetensors one tensor at a time, so that memory never holds more than the tensor at hand.

``safetensors.torch.save_file`` needs every tensor of a shard in memory at once (5 GB per shard for the usual
shard size). The format is simple enough to stream: 8-byte little-endian header length, a JSON header giving
each tensor's dtype, shape and byte range, then the raw little-endian bytes in header order. Shapes and dtypes
are known before any data is read, so the header is written first and the bytes follow as they are produced.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its HF name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Shard:
    filename: str
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(specs: Iterable[TensorSpec], max_shard_bytes: int) -> list[Shard]:
    """Split tensors, in the given order, into files of at most ``max_shard_bytes`` (a larger tensor gets a
    file of its own). Names follow transformers: ``model-00001-of-00003.safetensors``, or
    ``model.safetensors`` when one file suffices."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if groups[-1] and size + spec.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    if len(groups) == 1:
        return [Shard(SINGLE_FILE, tuple(groups[0]))]
    n = len(groups)
    return [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g)) for i, g in enumerate(groups)]


def _header(tensors: Iterable[TensorSpec]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in tensors:
        if spec.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{spec.name}: dtype {spec.dtype} cannot be stored in safetensors here")
        entries[spec.name] = {
            "dtype": SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the reference implementation aligns the data start to 8 bytes
    return struct.pack("<Q", len(header)) + header


def write_shard(path: Path, shard: Shard, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Write ``shard`` to ``path``, pulling exactly its tensors, in order, from ``tensors``; fsync at the end.

    Each pulled tensor must match its spec (name, shape, dtype): a mismatch raises before the file is done.
    """
    with open(path, "wb") as handle:
        handle.write(_header(shard.tensors))
        for spec in shard.tensors:
            name, tensor = next(tensors)
            if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise ValueError(
                    f"{path.name}: expected {spec.name} {spec.shape} {spec.dtype}, "
                    f"got {name} {tuple(tensor.shape)} {tensor.dtype}"
                )
            data = tensor.detach().to("cpu").contiguous().reshape(-1)
            # numpy's stubs declare ndarray's buffer protocol (__buffer__) for Python >= 3.12 only
            handle.write(memoryview(data.view(torch.uint8).numpy()))  # type: ignore[arg-type]
        handle.flush()
        os.fsync(handle.fileno())


def write_index(directory: Path, shards: list[Shard]) -> None:
    """``model.safetensors.index.json`` for a multi-file checkpoint (nothing for a single file)."""
    if len(shards) == 1 and shards[0].filename == SINGLE_FILE:
        return
    index = {
        "metadata": {"total_size": sum(s.nbytes for s in shards)},
        "weight_map": {t.name: s.filename for s in shards for t in s.tensors},
    }
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
