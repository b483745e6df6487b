"""Offline HF ⇄ Megatron conversion for Qwen3 / Qwen3-MoE: streaming, validated before writing, atomic.

``hf_to_megatron`` writes a torch_dist checkpoint that Megatron's own loader reads under any TP/PP/EP layout.
The keys, global shapes and SwiGLU factories come from megatron-core itself: the whole model is built on the
``meta`` device at TP1 in a one-process group and its ``sharded_state_dict()`` gives the layout
(:func:`sapo_megatron.megatron.dist_ckpt.reference_layout`). The checkpoint is then written through
``torch.distributed.checkpoint`` with a planner whose ``resolve_data`` builds each stored chunk from the HF
safetensors (through the mapping table) only when a writer thread reaches it, reading the needed rows straight
into place (:func:`row_runs`); a small thread pool builds the next chunks while the current ones are written.
Peak memory is a handful of parameters, not the model.

``megatron_to_hf`` reads parameters batch by batch (regions of the global tensors, so any saved layout works)
and streams them into size-bounded safetensors shards. ``verify`` runs one token batch through HF transformers and through the
Megatron model loaded from the Megatron checkpoint and reports the logit differences.

Every input problem (missing / unexpected / misshapen tensor, mixed dtypes, a config that disagrees with
the weights) raises :class:`ConversionError` naming the tensor before anything is written. Outputs are
written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException, save
from torch.distributed.checkpoint.planner import WriteItemType

from sapo_megatron.checkpoint import atomic, dcp_io, fused_experts
from sapo_megatron.checkpoint.hf_io import CheckpointError, HFCheckpointReader
from sapo_megatron.checkpoint.mapping import MappingError, Transform, hf_expected_shapes, resolve
from sapo_megatron.checkpoint.safetensors_stream import (
    TensorSpec,
    plan_shards,
    write_index,
    write_shard,
)
from sapo_megatron.data.tokenizer import HF_TOKENIZER_FILES, TOKENIZER_FILE
from sapo_megatron.errors import UserError
from sapo_megatron.model.arch import ArchError, QwenArch

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
DEFAULT_READ_BATCH_BYTES = 512 * 1024**2
DEFAULT_TOLERANCE = {"fp32": 1e-3, "bf16": 0.25}
"""Default bound on max |Δlogit| by compute dtype (the tests hold tiny models to 1e-4 in fp32)."""

PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
TOKENIZER_FILES = (
    *HF_TOKENIZER_FILES,
    "generation_config.json",
    TOKENIZER_FILE,  # the embedded demo's character tokenizer (sapo_megatron.data.tokenizer)
    *PROCESSOR_FILES,  # a vision-language model's image / video processor (SGLang builds its processor from them)
)
SAFETENSORS_DTYPE_NAMES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class ConversionError(UserError, ValueError):
    """Input that cannot be converted faithfully; the message names the tensor and what was expected."""


# --------------------------------------------------------------------------------------------------------
# Input validation (headers only, before anything is written)
# --------------------------------------------------------------------------------------------------------


def read_hf_config(hf_dir: Path) -> tuple[dict[str, Any], QwenArch]:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConversionError(f"{hf_dir} has no config.json")
    raw = json.loads(path.read_text())
    try:
        return raw, QwenArch.from_hf_dict(raw)
    except (ArchError, ValueError) as err:
        raise ConversionError(f"{path}: {err}") from err


def validate_hf_checkpoint(reader: HFCheckpointReader, arch: QwenArch) -> torch.dtype:
    """Names, shapes and dtypes of every tensor against the architecture (safetensors headers only).

    Returns the checkpoint's dtype. Raises :class:`ConversionError` listing wrong shapes first, then missing
    and unexpected tensors, with a hint when a config field visibly disagrees with the weights.
    """
    expected = hf_expected_shapes(arch)
    present = set(reader.names())
    header = {name: reader.shape_and_dtype(name) for name in sorted(present)}
    shapes = [
        f"tensor {n} has shape {header[n][0]}, the config implies {expected[n]}"
        for n in sorted(present & set(expected))
        if header[n][0] != expected[n]
    ]
    missing = [f"missing tensor {n} (expected shape {expected[n]})" for n in sorted(set(expected) - present)]
    unexpected = [
        f"unexpected tensor {n} (not part of this architecture)" for n in sorted(present - set(expected))
    ]
    problems = shapes[:10] + missing[:10] + unexpected[:10]
    if problems:
        hints = _config_hints(reader, arch)
        counts = f"{len(shapes)} wrong shapes, {len(missing)} missing, {len(unexpected)} unexpected"
        raise ConversionError(
            f"HF checkpoint {reader.directory} does not match its config.json ({counts}):\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "".join(f"\n  hint: {h}" for h in hints)
        )
    by_dtype: dict[str, list[str]] = {}
    for name, (_, dtype) in header.items():
        by_dtype.setdefault(dtype, []).append(name)
    main = max(by_dtype, key=lambda d: len(by_dtype[d]))
    problems = [
        f"tensor {n} has dtype {d}, expected {main} like the other {len(by_dtype[main])} tensors"
        for d, names in sorted(by_dtype.items())
        if d != main
        for n in names
    ]
    if main not in SAFETENSORS_DTYPE_NAMES:
        problems.insert(
            0, f"tensors are stored as {main}; expected one of {', '.join(SAFETENSORS_DTYPE_NAMES)}"
        )
    if problems:
        raise ConversionError(
            f"HF checkpoint {reader.directory} has inconsistent dtypes ({len(problems)} problems):\n"
            + "\n".join(f"  - {p}" for p in problems[:20])
        )
    return SAFETENSORS_DTYPE_NAMES[main]


_EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def _config_hints(reader: HFCheckpointReader, arch: QwenArch) -> list[str]:
    """Say which config field disagrees with the weights, when the tensor names make it clear."""
    names = reader.names()
    hints = []
    layers = {int(m.group(1)) for n in names if (m := _LAYER_NAME.match(n))}
    if layers and max(layers) + 1 != arch.num_hidden_layers:
        hints.append(
            f"config.json says num_hidden_layers={arch.num_hidden_layers}, the weights hold {max(layers) + 1} layers"
        )
    experts = {int(m.group(2)) for n in names if (m := _EXPERT_NAME.match(n))}
    if experts and max(experts) + 1 != arch.num_experts:
        hints.append(
            f"config.json says num_experts={arch.num_experts}, the weights hold {max(experts) + 1} experts per "
            "MoE layer"
        )
    if "model.embed_tokens.weight" in reader.weight_map:
        vocab, hidden = reader.shape_and_dtype("model.embed_tokens.weight")[0]
        if vocab != arch.vocab_size:
            hints.append(f"config.json says vocab_size={arch.vocab_size}, the embedding has {vocab} rows")
        if hidden != arch.hidden_size:
            hints.append(
                f"config.json says hidden_size={arch.hidden_size}, the embedding has {hidden} columns"
            )
    if arch.tie_word_embeddings and "lm_head.weight" in reader.weight_map:
        hints.append(
            "config.json says tie_word_embeddings=true but the weights hold a separate lm_head.weight"
        )
    if not arch.tie_word_embeddings and "lm_head.weight" not in reader.weight_map:
        hints.append("lm_head.weight is missing: is tie_word_embeddings=true missing from config.json?")
    return hints


# --------------------------------------------------------------------------------------------------------
# Plan: Megatron parameters (reference layout) ⇄ HF tensors
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamPlan:
    """One Megatron parameter of the reference layout, with the HF tensors it is made of."""

    layout: Any  # sapo_megatron.megatron.dist_ckpt.ParamLayout
    hf_names: tuple[str, ...]
    transform: Transform

    @property
    def name(self) -> str:
        return self.layout.name


def plan_params(layout, arch: QwenArch) -> list[ParamPlan]:
    """Match every reference-layout parameter with the table; shapes are checked on the meta device."""
    expected = hf_expected_shapes(arch)
    plans, problems = [], []
    for param in layout.params:
        try:
            resolved = resolve(param.name, arch)
        except MappingError as err:
            problems.append(str(err))
            continue
        transform = resolved.rule.transform
        hf_meta = [torch.empty(expected.get(n, (0,)), device="meta") for n in resolved.hf_names]
        missing = [n for n in resolved.hf_names if n not in expected]
        if missing:
            problems.append(f"{param.name} needs {', '.join(missing)}, which this architecture does not have")
            continue
        try:
            full_shape = tuple(transform.full(hf_meta, arch).shape)
        except RuntimeError as err:
            problems.append(f"{param.name} cannot be built from {', '.join(resolved.hf_names)}: {err}")
            continue
        if full_shape != param.shape:
            problems.append(
                f"{param.name} (from {', '.join(resolved.hf_names)}) would have shape {full_shape}, "
                f"Megatron expects {param.shape}"
            )
        plans.append(ParamPlan(param, resolved.hf_names, transform))
    used = {n for p in plans for n in p.hf_names}
    problems += [f"HF tensor {n} is not used by any Megatron parameter" for n in sorted(set(expected) - used)]
    if problems:
        raise ConversionError(
            "the mapping table and the Megatron model disagree:\n"
            + "\n".join(f"  - {p}" for p in problems[:20])
        )
    return plans


# --------------------------------------------------------------------------------------------------------
# HF → Megatron
# --------------------------------------------------------------------------------------------------------


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
        dtype = validate_hf_checkpoint(reader, arch)
        _convert_to_megatron(hf_dir, out_dir, raw_config, arch, reader, dtype, force, workers, progress)
    finally:
        reader.close()
    return out_dir


def _convert_to_megatron(hf_dir, out_dir, raw_config, arch, reader, dtype, force, workers, progress) -> None:
    from sapo_megatron.megatron import dist_ckpt

    with dist_ckpt.single_process_megatron():
        layout = dist_ckpt.reference_layout(dist_ckpt.build_meta_model(arch))
        plans = plan_params(layout, arch)
        tmp = atomic.prepare_output_dir(out_dir, force=force)
        try:
            total = _write_dcp(tmp, plans, layout.objects, reader, arch, dtype, workers, progress)
            dist_ckpt.write_reference_metadata(tmp)
            (tmp / atomic.HF_CONFIG).write_text(json.dumps(raw_config, indent=2) + "\n")
            atomic.fsync_tree(tmp)
            atomic.write_marker(
                tmp,
                "model",
                source=str(hf_dir.absolute()),
                dtype=str(dtype).removeprefix("torch."),
                parameters=len(plans),
                bytes=total,
                world_size=1,
            )
            atomic.publish(tmp, out_dir.absolute(), replace=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _write_dcp(tmp, plans, objects, reader, arch, dtype, workers, progress) -> int:
    """Write the DCP shards of ``plans`` into ``tmp``; returns the tensor bytes written."""
    items, where, blobs = [], {}, {}
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

    workers = workers or min(4, os.cpu_count() or 1)
    files = max(1, min(workers, 4))
    stream_end = [0] * len(plans)  # the writer thread of a parameter ends its file at this parameter index
    for group in dcp_io.ContiguousFileSystemWriter.split(items, files):
        indices = [
            where[(i.index.fqn, tuple(i.index.offset))][0] for i in group if i.type != WriteItemType.BYTE_IO
        ]
        for p_idx in indices:
            stream_end[p_idx] = max(indices) + 1
    total = sum(_numel(c.size) for p in plans for c in p.layout.chunks) * _itemsize(dtype)
    with _Materializer(plans, reader, arch, dtype, workers, stream_end, total, progress) as materializer:

        def resolve_item(item):
            if item.type == WriteItemType.BYTE_IO:
                return blobs[item.index.fqn]
            p_idx, c_idx = where[(item.index.fqn, tuple(item.index.offset))]
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


@contextlib.contextmanager
def _quiet_dcp_warnings() -> Iterator[None]:
    """DCP warns that a single-process save has no process group; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
        rows = part.reshape(chunk.local_shape)[(slice(None), *([0] * len(trail)))].tolist()
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

    def __init__(self, plans, reader, arch, dtype, workers, stream_end, total_bytes, progress) -> None:
        self.plans, self.reader, self.arch, self.dtype = plans, reader, arch, dtype
        self.stream_end = stream_end
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hf2mcore")
        self.lookahead = 2 * workers
        self.max_ahead_bytes = 256 * 1024**2
        self.futures: dict[int, concurrent.futures.Future] = {}
        self.remaining: dict[int, int] = {}
        self.taken: set[int] = set()
        self.ahead_bytes = 0
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.expected = hf_expected_shapes(arch)
        self.runs_cache: dict[tuple, list[list[RowRun]] | None] = {}
        self.bar = _progress_bar(total_bytes, "hf→megatron", progress)

    def __enter__(self) -> _Materializer:
        return self

    def __exit__(self, *exc) -> None:
        for future in self.futures.values():
            future.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.bar.close()

    def _param_bytes(self, p_idx: int) -> int:
        return _numel(self.plans[p_idx].layout.shape) * _itemsize(self.dtype)

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

    def _build(self, p_idx: int) -> list[torch.Tensor]:
        plan = self.plans[p_idx]
        runs = self._runs(plan)
        if runs is None:
            return self._build_through_transform(plan)
        out = [torch.empty(c.size, dtype=self.dtype) for c in plan.layout.chunks]
        for tensor, chunk, chunk_runs in zip(out, plan.layout.chunks, runs):
            rows = tensor.view(chunk.local_shape[0], -1)
            for hf_idx, hf_row, row, count in chunk_runs:
                self.reader.read_rows_into(plan.hf_names[hf_idx], hf_row, rows[row : row + count])
        return out

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
        tensor = chunks[c_idx]
        chunks[c_idx] = None
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


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)


# --------------------------------------------------------------------------------------------------------
# Megatron → HF
# --------------------------------------------------------------------------------------------------------


def megatron_to_hf(
    megatron_dir: str | Path,
    out_dir: str | Path,
    hf_reference: str | Path | None = None,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    read_batch_bytes: int = DEFAULT_READ_BATCH_BYTES,
    dtype: str | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Export a Megatron torch_dist checkpoint (saved under any layout) as an HF safetensors checkpoint.

    ``megatron_dir`` is a checkpoint (a conversion output, model weights or a training state), a folder with a
    ``latest`` pointer, or a training run's ``output_dir`` (its newest training state). ``out_dir`` must not
    be, contain or lie inside an input.

    Writes size-bounded shards (+ ``model.safetensors.index.json``), ``config.json`` from the HF config stored
    in the checkpoint (else from ``hf_reference``), and the tokenizer files of ``hf_reference``. Parameters are
    read in batches of about ``read_batch_bytes`` and streamed into the shards, so memory stays bounded by
    a batch, whatever the shard size. Every tensor is written in ``dtype`` ("fp32", "bf16", "fp16"; default:
    the stored dtype of the embedding, i.e. the model's parameter dtype; a training checkpoint of a bf16
    model keeps its norms in fp32, HF checkpoints do not).
    """
    out_dir = Path(out_dir)
    path = atomic.find_checkpoint(megatron_dir)
    atomic.refuse_overlap(
        out_dir, {"Megatron checkpoint (--megatron)": path, "HF reference (--hf-reference)": hf_reference}
    )
    atomic.refuse_overwrite(out_dir, force=force)
    atomic.read_marker(path)
    raw_config = _checkpoint_hf_config(path, hf_reference)
    try:
        arch = QwenArch.from_hf_dict(raw_config)
    except (ArchError, ValueError) as err:
        raise ConversionError(f"HF config of {path}: {err}") from err
    from sapo_megatron.megatron import dist_ckpt  # after the input checks: importing Megatron takes seconds

    with dist_ckpt.single_process_megatron():
        layout = dist_ckpt.reference_layout(dist_ckpt.build_meta_model(arch))
        plans = plan_params(layout, arch)
        dtypes = dist_ckpt.checkpoint_tensor_dtypes(path)
        _check_keys(path, plans, dtypes)
        out_dtype = _output_dtype(dtype, plans, dtypes)
        specs = _hf_specs(plans, arch, out_dtype)
        groups = fused_experts.fused_groups({s.name: s.shape for s in specs}) if arch.is_vl else []
        if groups:  # Qwen3-VL-MoE: experts stored fused, in the hub layout (what SGLang 0.5.23 loads)
            fused = fused_experts.fuse_specs([(s.name, s.shape) for s in specs])
            specs = [TensorSpec(name, shape, out_dtype) for name, shape in fused]
        shards = plan_shards(specs, max_shard_bytes)
        tmp = atomic.prepare_output_dir(out_dir, force=force)
        try:
            bar = _progress_bar(sum(s.nbytes for s in specs), "megatron→hf", progress)
            stream = _hf_tensor_stream(path, plans, arch, dtypes, out_dtype, read_batch_bytes, bar)
            stream = fused_experts.fuse_stream(stream, groups)
            for shard in shards:
                write_shard(tmp / shard.filename, shard, stream)
            bar.close()
            write_index(tmp, shards)
            config = dict(raw_config)
            for key in ("dtype", *(["torch_dtype"] if "torch_dtype" in config else [])):
                config[key] = str(out_dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            _copy_tokenizer(hf_reference, tmp)
            atomic.fsync_tree(tmp)
            atomic.publish(tmp, out_dir.absolute(), replace=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def _checkpoint_hf_config(path: Path, hf_reference: str | Path | None) -> dict[str, Any]:
    stored = path / atomic.HF_CONFIG
    if stored.is_file():
        return json.loads(stored.read_text())
    if hf_reference is not None and (Path(hf_reference) / "config.json").is_file():
        return json.loads((Path(hf_reference) / "config.json").read_text())
    raise ConversionError(
        f"{path} holds no {atomic.HF_CONFIG} (it was saved without an architecture); pass --hf-reference "
        "with a directory holding the model's config.json"
    )


def _check_keys(path: Path, plans: Sequence[ParamPlan], dtypes: dict[str, torch.dtype]) -> None:
    missing = sorted({c.key for p in plans for c in p.layout.chunks if c.key not in dtypes})
    if missing:
        raise ConversionError(
            f"checkpoint {path} lacks {len(missing)} tensors this architecture needs, e.g. "
            + ", ".join(missing[:5])
            + f"; is its {atomic.HF_CONFIG} the right one?"
        )


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _output_dtype(name: str | None, plans: Sequence[ParamPlan], dtypes) -> torch.dtype:
    if name is not None:
        if name not in _DTYPES:
            raise ConversionError(f"dtype {name!r} is not one of {', '.join(_DTYPES)}")
        return _DTYPES[name]
    embedding = next(p for p in plans if p.name == "embedding.word_embeddings.weight")
    return dtypes[embedding.layout.chunks[0].key]


def _hf_specs(plans: Sequence[ParamPlan], arch: QwenArch, dtype: torch.dtype) -> list[TensorSpec]:
    specs = []
    for plan in plans:
        full = torch.empty(plan.layout.shape, device="meta")
        parts = plan.transform.split_full(full, arch, len(plan.hf_names))
        specs += [TensorSpec(n, tuple(t.shape), dtype) for n, t in zip(plan.hf_names, parts)]
    return specs


def _batches(plans: Sequence[ParamPlan], batch_bytes: int, dtypes) -> list[list[ParamPlan]]:
    batches: list[list[ParamPlan]] = [[]]
    size = 0
    for plan in plans:
        nbytes = _numel(plan.layout.shape) * _itemsize(dtypes[plan.layout.chunks[0].key])
        if batches[-1] and size + nbytes > batch_bytes:
            batches.append([])
            size = 0
        batches[-1].append(plan)
        size += nbytes
    return batches


def _hf_tensor_stream(
    path, plans, arch, dtypes, out_dtype, batch_bytes, bar
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors in plan order; the next batch is read by a helper thread while this one is written."""
    from sapo_megatron.megatron import dist_ckpt

    batches = _batches(plans, batch_bytes, dtypes)

    def read(batch: list[ParamPlan]) -> dict[str, torch.Tensor]:
        return dist_ckpt.read_params(path, [p.layout for p in batch], dtypes)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mcore2hf") as pool:
        pending = pool.submit(read, batches[0]) if batches else None
        for i, batch in enumerate(batches):
            loaded = pending.result()
            pending = pool.submit(read, batches[i + 1]) if i + 1 < len(batches) else None
            for plan in batch:
                full = loaded.pop(plan.name)
                for name, tensor in zip(
                    plan.hf_names, plan.transform.split_full(full, arch, len(plan.hf_names))
                ):
                    bar.update(tensor.numel() * tensor.element_size())
                    yield name, tensor.to(out_dtype)


def _copy_tokenizer(hf_reference: str | Path | None, out: Path) -> None:
    if hf_reference is None:
        return
    for name in TOKENIZER_FILES:
        source = Path(hf_reference) / name
        if source.is_file():
            shutil.copyfile(source, out / name)


# --------------------------------------------------------------------------------------------------------
# Logit parity
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParityReport:
    """HF vs Megatron logits on one token batch."""

    max_abs: float
    mean_abs: float
    cosine: float
    tolerance: float
    dtype: str
    tokens: int
    differing: tuple[str, ...] = ()
    """HF tensors whose weights in the Megatron model differ from ``hf_dir``'s (after a cast to its dtype)."""

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.tolerance and not self.differing

    def summary(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        weights = (
            f"; {len(self.differing)} tensors differ from the HF checkpoint: {', '.join(self.differing[:5])}"
            if self.differing
            else "; every weight equals the HF checkpoint's"
        )
        return (
            f"logit parity ({self.dtype}, {self.tokens} tokens): max |Δlogit| = {self.max_abs:.3e}, "
            f"mean |Δlogit| = {self.mean_abs:.3e}, cosine = {self.cosine:.8f}; "
            f"tolerance max |Δlogit| <= {self.tolerance:.1e}{weights}: {verdict}"
        )


def verify(
    hf_dir: str | Path,
    megatron_dir: str | Path,
    *,
    tolerance: float | None = None,
    dtype: str = "fp32",
    batch: int = 2,
    seq_len: int = 32,
    seed: int = 0,
    parallel: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = print,
) -> ParityReport:
    """Run the same random token batch through HF transformers (from ``hf_dir``) and through the Megatron
    model loaded from ``megatron_dir``; compare the logits. A vision-language model gets rows of text and
    seeded images of several sizes (and a text-only row when ``batch`` >= 3); padding is not compared.

    Runs in the current process group when one exists (under ``torchrun``: every rank calls it, ``parallel``
    gives the layout, e.g. ``{"tp": 2, "sequence_parallel": True}``), else in a single process. The HF model
    runs on one rank of the last pipeline stage; every rank returns the same report.
    """
    import torch.distributed as dist

    from sapo_megatron.config import config_from_dict
    from sapo_megatron.megatron import dist_ckpt
    from sapo_megatron.megatron.model import BuildOptions, build_gpt_model

    hf_dir = Path(hf_dir)
    mc_path = atomic.find_checkpoint(megatron_dir)
    atomic.read_marker(mc_path)
    _, arch = read_hf_config(hf_dir)
    stored = _checkpoint_hf_config(mc_path, hf_dir)
    if QwenArch.from_hf_dict(stored) != arch:
        raise ConversionError(
            f"{mc_path}/{atomic.HF_CONFIG} and {hf_dir}/config.json describe different models"
        )
    tolerance = DEFAULT_TOLERANCE[dtype] if tolerance is None else tolerance
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    cfg = config_from_dict(
        {
            "model": {"hf_config": arch.to_hf_dict()},
            "parallel": parallel or {},
            "precision": {"dtype": dtype},
            "launch": {"procs_per_node": world},
        }
    )
    inputs = _parity_inputs(arch, batch, seq_len, seed)
    ids, real = inputs["input_ids"], inputs["attention_mask"].bool()
    vision = {k: inputs[k] for k in ("pixel_values", "image_grid_thw") if k in inputs}
    with dist_ckpt.parallel_context(cfg, seed=seed):
        model = build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision))
        dist_ckpt.load_model_weights(model, mc_path)
        logits = dist_ckpt.forward_logits(model, ids, **vision)
        figures = torch.zeros(4, dtype=torch.float64)
        if logits is not None and dist_ckpt.is_reporting_rank():
            figures = _compare(logits.cpu()[real], _hf_logits(hf_dir, inputs, dtype, arch)[real])
        figures = figures.to(_collective_device())
        dist.all_reduce(figures)
        figures = figures.cpu()
        differing = _differing_weights(model, arch, hf_dir)
        rank = dist.get_rank()
    report = ParityReport(
        max_abs=float(figures[0]),
        mean_abs=float(figures[1]),
        cosine=float(figures[2]),
        tolerance=tolerance,
        dtype=dtype,
        tokens=int(real.sum()),
        differing=differing,
    )
    if log is not None and rank == 0:
        log(report.summary())
    return report


def _differing_weights(model: torch.nn.Module, arch: QwenArch, hf_dir: Path) -> tuple[str, ...]:
    """Collective: the HF tensors (in HF order) whose copy in the loaded model is not bitwise the HF file's
    (after casting the file's to the model's dtype). Names a perturbed tensor that the logits may hide."""
    import torch.distributed as dist

    from sapo_megatron.megatron.weights import iter_hf_weights

    reader = HFCheckpointReader(hf_dir)
    try:
        mine = [
            name
            for name, tensor in iter_hf_weights(model, arch, owned_only=True)
            if not torch.equal(reader.get(name).to(tensor.dtype), tensor.cpu())
        ]
    finally:
        reader.close()
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    order = {name: i for i, name in enumerate(hf_expected_shapes(arch))}
    return tuple(sorted({n for names in gathered for n in names}, key=order.__getitem__))


def _collective_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _parity_inputs(arch: QwenArch, batch: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    """Random tokens ``[batch, seq_len]``; for a vision-language model, rows of text and seeded images of
    several sizes (two images, one image, text only, in turn), right-padded, with their processor outputs."""
    if not arch.is_vl:
        ids = torch.randint(
            0, arch.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed)
        )
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    from sapo_megatron.model.tiny import vl_batch

    unit = arch.vision.patch_size * arch.vision.spatial_merge_size  # one merged token per unit × unit pixels
    text = max(seq_len // 4, 1)
    patterns = [
        [text, (2 * unit, 2 * unit), text, (unit, 2 * unit), text],
        [text, (2 * unit, unit), 2 * text],
        [seq_len],
    ]
    return vl_batch(arch, [patterns[i % 3] for i in range(batch)], seed=seed)


def _hf_logits(hf_dir: Path, inputs: dict[str, torch.Tensor], dtype: str, arch: QwenArch) -> torch.Tensor:
    import transformers

    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    model_cls = transformers.AutoModelForImageTextToText if arch.is_vl else transformers.AutoModelForCausalLM
    model = model_cls.from_pretrained(str(hf_dir)).to(torch_dtype).eval()
    if not arch.is_vl:
        inputs = {"input_ids": inputs["input_ids"]}
    with torch.no_grad():
        return model(**inputs).logits.float()


def _compare(mc: torch.Tensor, hf: torch.Tensor) -> torch.Tensor:
    if mc.shape != hf.shape:
        raise ConversionError(f"logit shapes differ: Megatron {tuple(mc.shape)}, HF {tuple(hf.shape)}")
    diff = (mc.double() - hf.double()).abs()
    cosine = torch.nn.functional.cosine_similarity(mc.double().flatten(), hf.double().flatten(), dim=0)
    return torch.stack([diff.max(), diff.mean(), cosine, torch.ones((), dtype=torch.float64)])


__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DEFAULT_TOLERANCE",
    "ConversionError",
    "ParityReport",
    "hf_to_megatron",
    "megatron_to_hf",
    "plan_params",
    "read_hf_config",
    "validate_hf_checkpoint",
    "verify",
]
