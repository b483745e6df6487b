"""Streaming access to ``torch.distributed.checkpoint`` (DCP) directories, the storage under Megatron's torch_dist.

A DCP checkpoint stores each global tensor as chunks (``offsets``, ``sizes``) in ``*.distcp`` files, indexed by a
``.metadata`` file. Two tools, both single-process and both touching one piece at a time:

- :class:`LazySavePlanner`: a save plan made of precomputed chunks whose data is produced only when the writer
  reaches it (``resolve_data``), so that a whole model never sits in memory;
- :func:`read_regions`: read arbitrary slices of global tensors, whatever chunking the checkpoint was saved
  with (DCP's own resharding: every stored chunk overlapping a requested region is read and copied in).

Pure torch: no megatron.
"""

from __future__ import annotations

import math
import queue
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
    load,
)
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclass(frozen=True)
class Region:
    """``key[offset : offset + size]`` of a global checkpoint tensor, to be read as ``dtype``."""

    key: str
    offset: tuple[int, ...]
    size: tuple[int, ...]
    dtype: torch.dtype


def shard_write_item(
    key: str, offset: Sequence[int], size: Sequence[int], global_shape: Sequence[int], dtype: torch.dtype
) -> WriteItem:
    """A DCP write item for one chunk of a global tensor."""
    offsets = torch.Size(offset)
    return WriteItem(
        index=MetadataIndex(key, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(size)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(global_shape),
        ),
    )


def bytes_write_item(key: str) -> WriteItem:
    """A DCP write item for a serialised object (Megatron's ``ShardedObject``)."""
    return WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)


class LazySavePlanner(DefaultSavePlanner):
    """Save planner over precomputed write items whose data is produced only when the writer asks for it.

    With ``FileSystemWriter(thread_count=1)`` the writer asks in plan order, one item at a time.
    """

    def __init__(self, items: list[WriteItem], resolve_item: Callable[[WriteItem], Any]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items = items
        self._resolve_item = resolve_item

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        super().set_up_planner({}, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(list(self._items))
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        return self._resolve_item(write_item)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's default, minus its chunk-overlap validation, which is quadratic in the chunks of a key
        (hours for 6,144 expert chunks per key); :func:`check_tiling` does the same job in linear time."""
        global_plan, metadata = create_default_global_save_plan(all_plans)
        check_tiling(metadata)
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata


def check_tiling(metadata: Metadata) -> None:
    """Each tensor's chunks lie inside it, start at distinct offsets and add up to its volume: for the
    regular grids Megatron shards on, that is an exact tiling."""
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        volume, offsets = 0, set()
        for chunk in md.chunks:
            if any(o < 0 or o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, md.size)):
                raise ValueError(
                    f"{key}: chunk at {tuple(chunk.offsets)} {tuple(chunk.sizes)} exceeds {md.size}"
                )
            offsets.add(tuple(chunk.offsets))
            volume += math.prod(chunk.sizes)
        if len(offsets) != len(md.chunks) or volume != math.prod(md.size):
            raise ValueError(f"{key}: the chunks do not tile the tensor {tuple(md.size)} exactly")


class ContiguousFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` that splits the plan into ``thread_count`` *contiguous* runs of items of about equal
    size, one file and one thread each, so that every thread asks for its items in plan order (DCP's own split
    sorts them by size). A producer can then prepare each thread's next items ahead of it.
    """

    @staticmethod
    def split(items: Sequence[WriteItem], parts: int) -> list[list[WriteItem]]:
        sizes = [_item_bytes(item) for item in items]
        groups: list[list[WriteItem]] = [[]]
        total, acc = sum(sizes), 0
        for item, size in zip(items, sizes):
            if groups[-1] and acc >= total * len(groups) / parts and len(groups) < parts:
                groups.append([])
            groups[-1].append(item)
            acc += size
        return groups

    def write_data(self, plan: SavePlan, planner):
        if self.thread_count == 1 or not hasattr(self, "_write_data"):
            return super().write_data(plan, planner)
        file_queue: queue.Queue = queue.Queue()
        for i, group in enumerate(self.split(plan.items, self.thread_count)):
            name = f"{plan.storage_data.prefix}{i}.distcp"
            file_queue.put((self.fs.concat_path(self.path, name), name, group))
        return self._write_data(planner, file_queue)


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return (
        math.prod(item.tensor_data.chunk.sizes)
        * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
    )


def tensor_metadata(directory: str | Path) -> dict[str, TensorStorageMetadata]:
    """Global key → stored global shape, dtype and chunks (reads only ``.metadata``)."""
    metadata = FileSystemReader(str(directory)).read_metadata()
    return {
        key: md for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
    }


class _RegionLoadPlanner(DefaultLoadPlanner):
    """Load planner that reads requested regions into preallocated tensors (nothing else)."""

    def __init__(self, regions: Sequence[Region], targets: list[torch.Tensor]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._regions = regions
        self._targets = targets

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        super().set_up_planner({}, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        by_key: dict[str, list[int]] = {}
        for i, region in enumerate(self._regions):
            by_key.setdefault(region.key, []).append(i)
        items: list[ReadItem] = []
        self._target_of: dict[tuple[str, int | None], int] = {}
        if self.metadata is None:
            raise RuntimeError("the planner reads regions only after set_up_planner gave it the metadata")
        for key, indices in by_key.items():
            stored = self.metadata.state_dict_metadata.get(key)
            if not isinstance(stored, TensorStorageMetadata):
                raise KeyError(f"tensor {key!r} is not in the checkpoint")
            chunks = [
                ChunkStorageMetadata(torch.Size(self._regions[i].offset), torch.Size(self._regions[i].size))
                for i in indices
            ]
            for local, i in enumerate(indices):
                self._target_of[(key, local)] = i
            items += create_read_items_for_chunk_list(key, stored, chunks)
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self._targets[self._target_of[(read_item.dest_index.fqn, read_item.dest_index.index)]]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise AssertionError("only tensors are read")


def read_regions(directory: str | Path, regions: Sequence[Region]) -> list[torch.Tensor]:
    """The requested slices of global tensors, each as a new tensor of ``region.size`` and ``region.dtype``.

    Every stored chunk that overlaps a region is read (whole, as DCP stores it) and the overlap copied in,
    so any chunking works: a TP1 conversion, or a checkpoint saved under TP/PP/EP.
    """
    targets = [torch.empty(r.size, dtype=r.dtype) for r in regions]
    planner = _RegionLoadPlanner(regions, targets)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load({}, storage_reader=FileSystemReader(str(directory)), planner=planner, no_dist=True)
    return targets
