"""HF → Megatron: an HF Qwen3 / Qwen3-MoE safetensors checkpoint as a Megatron torch_dist checkpoint.

The output is a torch_dist checkpoint that Megatron's own loader reads under any TP/PP/EP layout. The keys,
global shapes and SwiGLU factories come from megatron-core itself: the whole model is built on the ``meta``
device at TP1 in a one-process group and its ``sharded_state_dict()`` gives the layout
(:func:`sapo_megatron.megatron.dist_ckpt.reference_layout`). The checkpoint is then written through
``torch.distributed.checkpoint`` with a planner whose ``resolve_data`` builds each stored chunk from the HF
safetensors (through the mapping table) only when a writer thread reaches it, reading the needed rows straight
into place (:func:`row_runs`); a small thread pool builds the next chunks while the current ones are written.
Peak memory is a handful of parameters, not the model. The input is validated (headers only) before anything
is written, and the output is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import os
import shutil
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import CheckpointException, save
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from sapo_megatron.checkpoint import atomic, dcp_io
from sapo_megatron.checkpoint.hf_io import CheckpointError, HFCheckpointReader
from sapo_megatron.checkpoint.mapping import hf_expected_shapes
from sapo_megatron.conversion.params import (
    ConversionError,
    ParamPlan,
    itemsize,
    numel,
    plan_params,
    progress_bar,
    read_hf_config,
    validate_hf_checkpoint,
)
from sapo_megatron.model.arch import QwenArch

if TYPE_CHECKING:
    from sapo_megatron.megatron.dist_ckpt import ObjectLayout


def hf_to_megatron(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    force: bool = False,
    workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Convert an HF Qwen3 / Qwen3-MoE safetensors checkpoint into a Megatron torch_dist checkpoint.

    The output loads with :func:`sapo_megatron.megatron.dist_ckpt.load_model_weights` (or Megatron's
    ``dist_checkpointing.load``) under any TP/PP/EP layout. Tensors keep their HF dtype. ``workers`` threads
    build parameters ahead of the writer (default: the CPU count, at most 4).
    """

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    atomic.refuse_overlap(out_dir, {"HF checkpoint (--hf)": hf_dir})
    atomic.refuse_overwrite(out_dir, force=force)
    raw_config, arch = read_hf_config(hf_dir)
    try:
        reader = HFCheckpointReader(hf_dir)
    except CheckpointError as err:
        raise ConversionError(str(err)) from None
    try:
        source = HFSource(hf_dir, raw_config, arch, reader, validate_hf_checkpoint(reader, arch))
        _convert(source, out_dir, WriteOptions(force, workers or min(4, os.cpu_count() or 1), progress))
    finally:
        reader.close()
    return out_dir


@dataclass(frozen=True)
class HFSource:
    """A validated HF checkpoint: its folder, config, architecture, open reader and (single) dtype."""

    directory: Path
    raw_config: dict[str, Any]
    arch: QwenArch
    reader: HFCheckpointReader
    dtype: torch.dtype


@dataclass(frozen=True)
class WriteOptions:
    """How to write: replace a non-empty output, builder threads, progress bar."""

    force: bool
    workers: int
    progress: bool


def _convert(source: HFSource, out_dir: Path, options: WriteOptions) -> None:
    from sapo_megatron.megatron import dist_ckpt

    with dist_ckpt.single_process_megatron():
        layout = dist_ckpt.reference_layout(dist_ckpt.build_meta_model(source.arch))
        plans = plan_params(layout, source.arch)
        tmp = atomic.prepare_output_dir(out_dir, force=options.force)
        try:
            total = _write_dcp(tmp, plans, layout.objects, source, options)
            dist_ckpt.write_reference_metadata(tmp)
            (tmp / atomic.HF_CONFIG).write_text(json.dumps(source.raw_config, indent=2) + "\n")
            atomic.fsync_tree(tmp)
            atomic.write_marker(
                tmp,
                "model",
                source=str(source.directory.absolute()),
                dtype=str(source.dtype).removeprefix("torch."),
                parameters=len(plans),
                bytes=total,
                world_size=1,
            )
            atomic.publish(tmp, out_dir.absolute(), replace=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _write_dcp(
    tmp: Path,
    plans: Sequence[ParamPlan],
    objects: Sequence[ObjectLayout],
    source: HFSource,
    options: WriteOptions,
) -> int:
    """Write the DCP shards of ``plans`` into ``tmp``; returns the tensor bytes written."""
    dtype = source.dtype
    items, where, blobs = _write_items(plans, objects, dtype)
    files = max(1, min(options.workers, 4))
    stream_end = [0] * len(plans)  # the writer thread of a parameter ends its file at this parameter index
    for group in dcp_io.ContiguousFileSystemWriter.split(items, files):
        indices = [where[_stored_at(i.index)][0] for i in group if i.type != WriteItemType.BYTE_IO]
        for p_idx in indices:
            stream_end[p_idx] = max(indices) + 1
    total = sum(numel(c.size) for p in plans for c in p.layout.chunks) * itemsize(dtype)
    with _Materializer(plans, source, options, stream_end, total) as materializer:

        def resolve_item(item: WriteItem) -> io.BytesIO | torch.Tensor:
            if item.type == WriteItemType.BYTE_IO:
                return blobs[item.index.fqn]
            p_idx, c_idx = where[_stored_at(item.index)]
            return materializer.chunk(p_idx, c_idx)

        planner = dcp_io.LazySavePlanner(items, resolve_item)
        writer = dcp_io.ContiguousFileSystemWriter(str(tmp), thread_count=files, sync_files=True)
        try:
            with _quiet_dcp_warnings():
                save(state_dict={}, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as err:
            if materializer.error is not None:  # report the conversion's own error, not DCP's wrapper
                raise materializer.error from err
            raise
    return total


def _write_items(
    plans: Sequence[ParamPlan], objects: Sequence[ObjectLayout], dtype: torch.dtype
) -> tuple[list[WriteItem], dict[tuple[str, tuple[int, ...]], tuple[int, int]], dict[str, io.BytesIO]]:
    """The DCP write items (objects first, then every chunk of every parameter), where each chunk comes from
    (``(key, offset)`` → ``(parameter index, chunk index)``) and the serialised objects."""
    items: list[WriteItem] = []
    where: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
    blobs: dict[str, io.BytesIO] = {}
    for obj in objects:
        items.append(dcp_io.bytes_write_item(obj.unique_key))
        buffer = io.BytesIO()
        torch.save([obj.data], buffer)  # how Megatron stores a ShardedObject
        blobs[obj.unique_key] = buffer
    for p_idx, plan in enumerate(plans):
        for c_idx, chunk in enumerate(plan.layout.chunks):
            items.append(
                dcp_io.shard_write_item(chunk.key, chunk.offset, chunk.size, chunk.global_shape, dtype)
            )
            where[(chunk.key, tuple(chunk.offset))] = (p_idx, c_idx)
    return items, where, blobs


def _stored_at(index: MetadataIndex) -> tuple[str, tuple[int, ...]]:
    """A tensor chunk's write item as (key, offset) (a tensor item always has an offset)."""
    return index.fqn, tuple(index.offset or ())


@contextlib.contextmanager
def _quiet_dcp_warnings() -> Iterator[None]:
    """DCP warns that a single-process save has no process group; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


RowRun = tuple[int, int, int, int]
"""``(hf_index, hf_first_row, chunk_first_row, rows)``: rows copied verbatim from an HF tensor into a chunk."""


def row_runs(
    plan: ParamPlan, hf_shapes: Sequence[tuple[int, ...]], arch: QwenArch
) -> list[list[RowRun]] | None:
    """How each stored chunk of a parameter is made of whole rows of its HF tensors, or ``None``.

    Found by running the parameter's own transform and checkpoint factory on row *labels* instead of weights
    (an ``[rows, 1]`` tensor per HF input, broadcast to the parameter's shape, no memory): wherever the
    result is a permutation of whole HF rows (QKV regrouping, gate/up concatenation, identity), each chunk
    can be filled by reading those rows straight from the file, with no intermediate tensor.
    """
    trailing = {tuple(shape[1:]) for shape in hf_shapes}
    if len(trailing) != 1 or any(len(shape) == 0 for shape in hf_shapes):
        return None
    (trail,) = trailing
    shape = plan.layout.shape
    if tuple(shape[1:]) != trail or any(tuple(c.local_shape[1:]) != trail for c in plan.layout.chunks):
        return None
    ones = (1,) * len(trail)
    labels = [
        (torch.arange(s[0], dtype=torch.int64) + (i << 40)).reshape(s[0], *ones)
        for i, s in enumerate(hf_shapes)
    ]
    try:
        full = plan.transform.full(labels, arch)
    except (RuntimeError, ValueError):
        return None
    if tuple(full.shape) != (shape[0], *ones):
        return None
    runs = []
    for part, chunk in zip(plan.layout.split(full.expand(shape)), plan.layout.chunks):
        first_column = (slice(None),) + (0,) * len(trail)
        rows = part.reshape(chunk.local_shape)[first_column].tolist()
        chunk_runs, start = [], 0
        for k in range(1, len(rows) + 1):
            if k == len(rows) or rows[k] != rows[k - 1] + 1:
                chunk_runs.append((rows[start] >> 40, rows[start] & ((1 << 40) - 1), start, k - start))
                start = k
        runs.append(chunk_runs)
    return runs


class _Materializer:
    """Builds the stored chunks of each Megatron parameter from the HF files ahead of the DCP writer threads.

    Each writer thread takes a contiguous run of the plan in order; when it asks for a parameter, the next
    few parameters of its run are submitted to the pool (bounded by count and bytes), and a parameter is
    dropped once all its chunks are taken. Chunks are filled by reading HF rows straight into them
    (:func:`row_runs`), else built through the table's transform.
    """

    def __init__(
        self,
        plans: Sequence[ParamPlan],
        source: HFSource,
        options: WriteOptions,
        stream_end: Sequence[int],
        total_bytes: int,
    ) -> None:
        self.plans, self.reader, self.arch, self.dtype = plans, source.reader, source.arch, source.dtype
        self.stream_end = stream_end
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=options.workers, thread_name_prefix="hf2mcore"
        )
        self.lookahead = 2 * options.workers
        self.max_ahead_bytes = 256 * 1024**2
        self.futures: dict[int, concurrent.futures.Future[dict[int, torch.Tensor]]] = {}
        self.remaining: dict[int, int] = {}
        self.taken: set[int] = set()
        self.ahead_bytes = 0
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.expected = hf_expected_shapes(self.arch)
        self.runs_cache: dict[tuple[Any, ...], list[list[RowRun]] | None] = {}
        self.bar = progress_bar(total_bytes, "hf→megatron", options.progress)

    def __enter__(self) -> _Materializer:
        return self

    def __exit__(self, *exc: object) -> None:
        for future in self.futures.values():
            future.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.bar.close()

    def _param_bytes(self, p_idx: int) -> int:
        return numel(self.plans[p_idx].layout.shape) * itemsize(self.dtype)

    def _submit(self, p_idx: int) -> None:
        if p_idx in self.futures or p_idx in self.taken:
            return
        self.futures[p_idx] = self.pool.submit(self._build, p_idx)
        self.remaining[p_idx] = len(self.plans[p_idx].layout.chunks)
        self.ahead_bytes += self._param_bytes(p_idx)

    def _runs(self, plan: ParamPlan) -> list[list[RowRun]] | None:
        hf_shapes = tuple(self.expected[n] for n in plan.hf_names)
        key = (
            id(plan.transform),
            plan.layout.shape,
            tuple(c.local_shape for c in plan.layout.chunks),
            hf_shapes,
        )
        with self.lock:
            if key not in self.runs_cache:
                self.runs_cache[key] = row_runs(plan, hf_shapes, self.arch)
            return self.runs_cache[key]

    def _build(self, p_idx: int) -> dict[int, torch.Tensor]:
        """Chunk index → the chunk's tensor; each is popped when a writer takes it."""
        plan = self.plans[p_idx]
        runs = self._runs(plan)
        if runs is None:
            return dict(enumerate(self._build_through_transform(plan)))
        out = [torch.empty(c.size, dtype=self.dtype) for c in plan.layout.chunks]
        for tensor, chunk, chunk_runs in zip(out, plan.layout.chunks, runs):
            rows = tensor.view(chunk.local_shape[0], -1)
            for hf_idx, hf_row, row, count in chunk_runs:
                self.reader.read_rows_into(plan.hf_names[hf_idx], hf_row, rows[row : row + count])
        return dict(enumerate(out))

    def _build_through_transform(self, plan: ParamPlan) -> list[torch.Tensor]:
        hf = [self.reader.get_unmapped(name) for name in plan.hf_names]
        full = plan.transform.full(hf, self.arch)
        if tuple(full.shape) != plan.layout.shape or full.dtype != self.dtype:
            raise ConversionError(
                f"{plan.name} built from {', '.join(plan.hf_names)} has shape {tuple(full.shape)} "
                f"{full.dtype}, expected {plan.layout.shape} {self.dtype}"
            )
        return [_compact(c) for c in plan.layout.split(full)]

    def chunk(self, p_idx: int, c_idx: int) -> torch.Tensor:
        with self.lock:
            self._submit(p_idx)
            for ahead in range(p_idx + 1, min(p_idx + 1 + self.lookahead, self.stream_end[p_idx])):
                if self.ahead_bytes >= self.max_ahead_bytes:
                    break
                self._submit(ahead)
            future = self.futures[p_idx]
        try:
            chunks = future.result()
        except BaseException as err:
            self.error = err
            raise
        tensor = chunks.pop(c_idx)
        with self.lock:
            self.remaining[p_idx] -= 1
            if self.remaining[p_idx] == 0:
                del self.futures[p_idx], self.remaining[p_idx]
                self.taken.add(p_idx)
                self.ahead_bytes -= self._param_bytes(p_idx)
        self.bar.update(tensor.numel() * tensor.element_size())
        return tensor


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor owning exactly its bytes (what the DCP writer serialises without copying again)."""
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor
