"""Megatron distributed checkpoints (``torch_dist``): model weights and training state, atomic, any layout.

A torch_dist checkpoint stores every tensor under a *global* key with its *global* shape (layers and experts
stacked on leading axes, tensor-parallel shards reassembled), so a checkpoint written under one TP/PP/EP layout
loads under any other: Megatron reads, on each rank, exactly the slices that rank's parameters cover.

Saves follow :mod:`sapo_megatron.checkpoint.atomic`: all ranks write into ``.<name>.partial``, rank 0 fsyncs,
writes the completion marker and ``hf_config.json``, renames the directory into place and, for training state,
moves the ``latest`` pointer. Loads refuse a directory without the marker.

Also here, because they need ``megatron.core``: the single-process Megatron state that offline tools run in,
and the reference (TP1) checkpoint layout that offline conversion writes and reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import pickle
import queue
import random
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from megatron.core.models.gpt import GPTModel

from sapo_megatron.checkpoint import atomic, dcp_io
from sapo_megatron.checkpoint.atomic import IncompleteCheckpointError
from sapo_megatron.config import ModelConfig, ParallelConfig, PrecisionConfig
from sapo_megatron.errors import UserError
from sapo_megatron.megatron.model import BuildOptions, build_model_chunk, transformer_config
from sapo_megatron.megatron.weights import unwrap
from sapo_megatron.model.arch import QwenArch

logger = logging.getLogger(__name__)

RNG_KEY = "sapo_rng_state"
_EXTRA_STATE = "_extra_state"


class CheckpointMismatchError(UserError, ValueError):
    """A checkpoint whose tensors do not fit the model it is loaded into."""


# --------------------------------------------------------------------------------------------------------
# Offline tools: a one-process Megatron state and the reference (TP1) layout of a checkpoint
# --------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """Megatron's parallel state at TP1/PP1/EP1 in a one-process gloo group, torn down on exit.

    For offline tools (conversion). Inside a job that already has a process group this is a no-op when that
    group is a single process; a multi-process caller must use its own layout instead.
    """
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("offline conversion runs in a single process; call it outside torchrun")
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel()
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        yield
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def build_meta_model(arch: QwenArch) -> GPTModel:
    """The whole model (TP1/PP1/EP1) on the ``meta`` device: names, shapes and checkpoint keys, no memory.

    Local layer spec and the all-gather dispatcher: both build without CUDA, and Megatron gives the local
    spec the same checkpoint keys as Transformer Engine's (``linear_qkv.layer_norm_weight``, ...).
    """
    opts = BuildOptions(
        ModelConfig(hf_config=arch.to_hf_dict(), moe_token_dispatcher="allgather"),
        ParallelConfig(),
        PrecisionConfig(dtype="fp32"),
        use_te=False,
    )
    config = transformer_config(opts)
    config.use_cpu_initialization = True  # an explicit CUDA device would bypass the meta device
    config.perform_initialization = False
    with torch.device("meta"):
        return build_model_chunk(opts, config, pre_process=True, post_process=True, layout_only=True)


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a global checkpoint tensor: ``key[offset : offset + size]``."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    size: tuple[int, ...]  # with the leading (layer / expert) axes of size 1
    local_shape: tuple[int, ...]  # without them: the tensor Megatron's factories split / merge


@dataclass(frozen=True)
class ParamLayout:
    """Where one Megatron parameter (TP1, i.e. its full tensor) lives in a torch_dist checkpoint.

    ``name`` is the global Megatron parameter name (the mapping table's vocabulary); a factory (SwiGLU
    ``linear_fc1``) stores a parameter as several chunks.
    """

    name: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    _entry: ShardedTensor | ShardedTensorFactory

    def split(self, full: torch.Tensor) -> list[torch.Tensor]:
        """The chunk tensors (each shaped ``chunk.size``) that store ``full``, in :attr:`chunks` order."""
        if isinstance(self._entry, ShardedTensorFactory):
            built = _leaves(dataclasses.replace(self._entry, data=full).build())
            datas = [sh.data for sh in built]
        else:
            datas = [full]
        return [d.reshape(c.size) for d, c in zip(datas, self.chunks)]

    def merge(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full parameter from its chunk tensors (inverse of :meth:`split`)."""
        local = [p.reshape(c.local_shape) for p, c in zip(parts, self.chunks)]
        if isinstance(self._entry, ShardedTensorFactory):
            return self._entry.merge_fn(local).reshape(self.shape)
        return local[0].reshape(self.shape)


@dataclass(frozen=True)
class ObjectLayout:
    """A non-tensor entry (``_extra_state``) of the checkpoint, stored as Megatron stores it."""

    unique_key: str
    data: Any


@dataclass(frozen=True)
class ReferenceLayout:
    params: tuple[ParamLayout, ...]
    objects: tuple[ObjectLayout, ...]


def _leaves(built: Any) -> list[ShardedTensor]:
    leaves = list(nested_values(built)) if isinstance(built, (dict, list)) else [built]
    if not all(isinstance(x, ShardedTensor) for x in leaves):
        raise NotImplementedError(f"unsupported sharded factory output {type(built).__name__}")
    return leaves


def _chunk(sh: ShardedTensor) -> Chunk:
    size = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    if sh.flattened_range is not None or len(sh.global_offset) != len(sh.global_shape):
        raise NotImplementedError(f"flattened / irregular sharded tensor {sh.key} is not supported")
    return Chunk(sh.key, tuple(sh.global_shape), tuple(sh.global_offset), size, tuple(sh.local_shape))


def reference_layout(model: GPTModel) -> ReferenceLayout:
    """The checkpoint layout of a TP1/PP1/EP1 model (see :func:`build_meta_model`): for each parameter the
    keys and global slices that store it, with this megatron-core version's own key names and factories."""
    params, objects = [], []
    for name, entry in model.sharded_state_dict().items():
        if isinstance(entry, ShardedObject):
            objects.append(ObjectLayout(entry.unique_key, entry.data))
        elif isinstance(entry, ShardedTensorFactory):
            meta_chunks = _leaves(entry.build())
            params.append(
                ParamLayout(name, tuple(entry.data.shape), tuple(_chunk(s) for s in meta_chunks), entry)
            )
        elif isinstance(entry, ShardedTensor):
            params.append(ParamLayout(name, tuple(entry.local_shape), (_chunk(entry),), entry))
        else:
            raise NotImplementedError(f"unexpected entry {name}: {type(entry).__name__}")
    return ReferenceLayout(tuple(params), tuple(objects))


def checkpoint_tensor_dtypes(directory: str | Path) -> dict[str, torch.dtype]:
    """Global key → stored dtype, from the checkpoint metadata (no tensor is read)."""
    return {key: md.properties.dtype for key, md in dcp_io.tensor_metadata(directory).items()}


def write_reference_metadata(directory: str | Path) -> None:
    """The two small files that make a directory of DCP shards a Megatron checkpoint: ``metadata.json``
    (backend and version, written by Megatron's own function) and the legacy ``common.pt`` (empty common
    state), which every megatron-core version from 0.16 on reads."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    torch.save({}, Path(directory) / "common.pt")
    save_config(CheckpointingConfig("torch_dist", 1), str(directory))


def read_params(
    directory: str | Path, params: Sequence[ParamLayout], dtypes: dict[str, torch.dtype]
) -> dict[str, torch.Tensor]:
    """Read whole parameters (TP1 tensors, in their stored dtype) from a torch_dist checkpoint saved under
    any layout: the chunks of the reference layout are read as regions of the global tensors, then merged
    with this megatron-core version's factories."""
    regions = [
        dcp_io.Region(c.key, c.offset, c.size, dtypes[p.chunks[0].key]) for p in params for c in p.chunks
    ]
    parts = iter(dcp_io.read_regions(directory, regions))
    return {p.name: p.merge([next(parts) for _ in p.chunks]) for p in params}


# --------------------------------------------------------------------------------------------------------
# Atomic distributed save
# --------------------------------------------------------------------------------------------------------


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sharded_metadata() -> dict[str, Any]:
    """The ``metadata`` Megatron-LM passes to ``sharded_state_dict`` (its defaults, made explicit)."""
    return {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "distrib_optim_sharding_type": "dp_reshardable",
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, quota, permissions); earlier checkpoints are intact."""


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def _explain_disk_errors(final: Path) -> Iterator[None]:
    """A full disk or a write error while saving, as one line naming the checkpoint and what is still intact."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        text = str(exc)
        full = getattr(exc, "errno", None) in _DISK_FULL or "No space left" in text or "quota" in text.lower()
        if not isinstance(exc, OSError) and not full:
            raise
        cause = (
            "the disk is full" if full else f"{type(exc).__name__}: {text.splitlines()[0] if text else exc}"
        )
        raise CheckpointWriteError(
            f"cannot write checkpoint {final}: {cause}; the checkpoints before it (see {final.parent}/latest) "
            "are intact",
            hint=f"free space under {final.parent} (or lower trainer.keep_checkpoints), then resume with --resume",
        ) from exc


def _save_atomically(
    directory: str | Path,
    state: dict[str, Any],
    *,
    kind: str,
    hf_config: dict[str, Any] | None,
    info: dict[str, Any],
    point_latest: bool,
    files: dict[str, bytes] | None = None,
) -> Path:
    """All ranks: write ``state`` with Megatron into ``.<name>.partial``; rank 0 adds ``files``, makes it
    durable and renames it to ``directory``. Returns the final path."""
    final = Path(directory).absolute()
    tmp = atomic.partial_path(final)
    if _is_rank0():
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by an interrupted save of the same name
        tmp.mkdir()
    _barrier()
    with _in_process_write_results(), _explain_disk_errors(final):
        dist_checkpointing.save(state, str(tmp))
    _barrier()
    if _is_rank0():
        with _explain_disk_errors(final):
            if hf_config is not None:
                (tmp / atomic.HF_CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n")
            for name, data in (files or {}).items():
                (tmp / name).write_bytes(data)
            atomic.fsync_tree(tmp)
            atomic.write_marker(tmp, kind, megatron_core=_megatron_version(), **info)
            atomic.fsync_path(tmp)
            atomic.publish(tmp, final, replace=True)
            if point_latest:
                atomic.update_latest(final)
    _barrier()
    return final


@contextlib.contextmanager
def _in_process_write_results() -> Iterator[None]:
    """Collect megatron-core's write results in a plain queue during a synchronous save.

    megatron-core gathers them through a ``multiprocessing`` Manager queue, i.e. a server process that it
    starts once and that outlives a trainer killed mid-run (SIGKILL, preemption, ``os._exit``), keeping the
    trainer's stdout/stderr open so that whoever waits for them hangs. A synchronous save runs the writer
    in this process, where a plain queue does the same job.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


def _megatron_version() -> str:
    import megatron.core

    return str(getattr(megatron.core, "__version__", "unknown"))


def _layout_info() -> dict[str, int]:
    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "ep": parallel_state.get_expert_model_parallel_world_size(),
        "etp": parallel_state.get_expert_tensor_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
    }


# --------------------------------------------------------------------------------------------------------
# Model weights
# --------------------------------------------------------------------------------------------------------


def save_model_weights(
    model: torch.nn.Module, directory: str | Path, *, arch: QwenArch | None = None
) -> Path:
    """Save this model's weights (every rank calls it) as a torch_dist checkpoint at ``directory``.

    With ``arch`` the HF config is stored alongside, so that ``megatron-to-hf`` can export it alone.
    """
    gpt = unwrap(model)
    state = gpt.sharded_state_dict(metadata=_sharded_metadata())
    hf_config = arch.to_hf_dict() if arch is not None else None
    return _save_atomically(
        directory, state, kind="model", hf_config=hf_config, info=_layout_info(), point_latest=False
    )


@torch.no_grad()
def load_model_weights(model: torch.nn.Module, directory: str | Path) -> dict[str, Any]:
    """Load weights saved under any layout into this rank's shards (every rank calls it).

    ``directory`` is a checkpoint (model weights, a conversion output or a training state) or a folder
    whose ``latest`` pointer names one. Returns the checkpoint's completion marker. Raises
    :class:`~sapo_megatron.checkpoint.atomic.IncompleteCheckpointError` for a directory without a marker and
    :class:`CheckpointMismatchError` naming the tensor when a key is missing or a global shape differs.
    """
    path = atomic.resolve_checkpoint(directory)
    marker = atomic.read_marker(path)
    gpt = unwrap(model)
    state = gpt.sharded_state_dict(metadata=_sharded_metadata())
    state = _fit_to_checkpoint(state, path)
    loaded = dist_checkpointing.load(state, str(path))
    missing, unexpected = gpt.load_state_dict(loaded, strict=False)
    wrong = [k for k in [*missing, *unexpected] if not k.endswith(_EXTRA_STATE)]
    if wrong:
        raise CheckpointMismatchError(f"{path}: parameters not restored: {', '.join(wrong[:10])}")
    return marker


def _fit_to_checkpoint(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """Check every tensor the model asks for against the checkpoint metadata; drop ``_extra_state`` objects
    the checkpoint lacks (e.g. FP8 scaling state of a model whose checkpoint was written without TE)."""
    stored = load_sharded_metadata(str(path))
    problems = []
    for name, entry in list(state.items()):
        if isinstance(entry, ShardedObject):
            if entry.unique_key not in stored:
                del state[name]
            continue
        tensors = _leaves(entry.build()) if isinstance(entry, ShardedTensorFactory) else [entry]
        for sh in tensors:
            have = stored.get(sh.key)
            if have is None:
                problems.append(f"{name}: key {sh.key} is not in the checkpoint")
            elif tuple(have.global_shape) != tuple(sh.global_shape):
                problems.append(
                    f"{name}: checkpoint key {sh.key} has global shape {tuple(have.global_shape)}, "
                    f"the model expects {tuple(sh.global_shape)}"
                )
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {path} does not fit this model ({len(problems)} problems; compare its "
            f"{atomic.HF_CONFIG} with the model config):\n" + "\n".join(f"  - {p}" for p in problems[:20])
        )
    return state


# --------------------------------------------------------------------------------------------------------
# Training state: model + optimizer + LR schedule + RNG of every rank + a small JSON ``extra``
# --------------------------------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_object(data: Any) -> ShardedObject:
    """The RNG states of this rank: one object per global rank (restored only into the same world size)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    return ShardedObject(RNG_KEY, data, (world,), (rank,), replica_id=0)


def _train_state_dict(engine, *, is_loading: bool) -> dict[str, Any]:
    metadata = _sharded_metadata()
    chunks = engine.model
    models = {
        ("model" if len(chunks) == 1 else f"model{i}"): unwrap(c).sharded_state_dict(metadata=metadata)
        for i, c in enumerate(chunks)
    }
    state: dict[str, Any] = dict(models)
    state["optimizer"] = engine.optimizer.sharded_state_dict(
        models, is_loading=is_loading, metadata=_sharded_metadata()
    )
    state["scheduler"] = engine.scheduler.state_dict()
    state["rng"] = _rng_object(None if is_loading else _rng_state())
    return state


def save_train_state(
    engine,
    directory: str | Path,
    extra: dict[str, Any],
    *,
    keep: int | None = None,
    files: dict[str, bytes] | None = None,
) -> Path:
    """Save a :class:`~sapo_megatron.megatron.train_step.TrainEngine`'s full state (every rank calls it).

    Model and optimizer go through Megatron's sharded state dicts (``optimizer.sharded_state_dict`` over the
    model's), the LR schedule as common state, the RNG states of every rank as one object per rank, and
    ``extra`` (JSON-able: step, data position, ...) into the completion marker. The parent folder's
    ``latest`` pointer moves to ``directory`` once it is complete; with ``keep``, only the newest ``keep``
    training states of that folder are kept (the others are deleted after the new one is complete). ``files``
    (name -> contents; rank 0's are written) go into the checkpoint before it is published.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    try:
        extra_json = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as err:
        raise TypeError(f"save_train_state: extra must be JSON-serialisable ({err})") from err
    state = _train_state_dict(engine, is_loading=False)
    final = _save_atomically(
        directory,
        state,
        kind="train_state",
        hf_config=engine.cfg.model.arch.to_hf_dict(),
        info={"extra": extra_json, **_layout_info()},
        point_latest=True,
        files=files,
    )
    if keep is not None and _is_rank0():
        _prune_train_states(final, keep)
    _barrier()
    return final


def _prune_train_states(newest: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest complete training states next to ``newest`` (never ``newest``)."""
    found = []
    for sibling in newest.parent.iterdir():
        if not sibling.is_dir() or sibling.name.startswith("."):
            continue
        try:
            marker = atomic.read_marker(sibling)
        except IncompleteCheckpointError:
            continue
        if marker.get("kind") == "train_state":
            found.append((marker.get("created_unix", 0.0), sibling))
    found.sort(key=lambda item: item[0], reverse=True)
    for _, old in found[keep:]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)


def _ensure_optimizer_state(optimizer) -> None:
    """Give a fresh (never stepped) Adam its state tensors, zero, as its first step would.

    Megatron's distributed optimizer describes its checkpoint through the torch optimizer's state, which
    torch creates lazily; without Apex / Transformer Engine (CPU) an unstepped optimizer cannot build the
    sharded state dict it is loaded through. The values are overwritten by the load.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if state:
                    continue
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _restore_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam step counter, set from the step the checkpoint records.

    With torch's Adam (no Apex / TE), Megatron's distributed optimizer stores one ``step`` per parameter group
    and, on load, hands all parameters one shared step tensor (which torch then increments once per
    parameter) and may leave the per-parameter counters at their template value. The bias correction of the
    next update depends on it, so restore it explicitly.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = inner.state.get(param)
                if state and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


def _load_or_explain(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """``dist_checkpointing.load``, with a damaged file (truncated shard, missing ``.metadata``) named in one line
    instead of a bare ``EOFError``; read_marker's size check catches most of these before (and resume falls back)."""
    try:
        return dist_checkpointing.load(state, str(path))
    except (EOFError, OSError, pickle.UnpicklingError, ValueError) as exc:
        raise IncompleteCheckpointError(
            f"{path} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'truncated'})"
            "; the checkpoint is damaged: resume from the previous one (remove this directory)"
        ) from exc


@torch.no_grad()
def load_train_state(engine, directory: str | Path) -> dict[str, Any]:
    """Restore what :func:`save_train_state` wrote into ``engine`` (every rank calls it); returns ``extra``.

    ``directory`` is the checkpoint or its parent folder (then ``latest`` decides). The RNG states are
    restored when the world size matches the saved one (otherwise a warning says they were not).
    """
    path = atomic.resolve_checkpoint(directory)
    marker = atomic.read_marker(path)
    if marker.get("kind") != "train_state":
        raise IncompleteCheckpointError(
            f"{path} holds {marker.get('kind')!r}, not a training state; use load_model_weights for weights"
        )
    _ensure_optimizer_state(engine.optimizer)
    state = _train_state_dict(engine, is_loading=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    restore_rng = marker.get("world_size") == world
    if not restore_rng:
        del state["rng"]
        logger.warning(
            "%s was saved by %s ranks, this job has %s: RNG states are not restored",
            path,
            marker.get("world_size"),
            world,
        )
    for name in [k for k in state if k.startswith("model")]:
        state[name] = _fit_to_checkpoint(state[name], path)
    loaded = _load_or_explain(state, path)
    for i, chunk in enumerate(engine.model):
        key = "model" if len(engine.model) == 1 else f"model{i}"
        missing, unexpected = unwrap(chunk).load_state_dict(loaded[key], strict=False)
        wrong = [k for k in [*missing, *unexpected] if not k.endswith(_EXTRA_STATE)]
        if wrong:
            raise CheckpointMismatchError(f"{path}: parameters not restored: {', '.join(wrong[:10])}")
    engine.optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(engine.optimizer)
    engine.scheduler.load_state_dict(loaded["scheduler"])
    if restore_rng:
        _set_rng_state(loaded["rng"])
    return dict(marker.get("extra", {}))


def load_latest_train_state(engine, root: str | Path) -> dict[str, Any]:
    """:func:`load_train_state` from the checkpoint that ``root/latest`` names; returns its ``extra``."""
    pointer = Path(root) / atomic.LATEST
    if not pointer.is_file():
        raise IncompleteCheckpointError(f"no training state to resume from: {pointer} does not exist")
    return load_train_state(engine, root)


__all__ = [
    "CheckpointMismatchError",
    "IncompleteCheckpointError",
    "ParamLayout",
    "ReferenceLayout",
    "build_meta_model",
    "checkpoint_tensor_dtypes",
    "load_latest_train_state",
    "load_model_weights",
    "load_train_state",
    "read_params",
    "reference_layout",
    "save_model_weights",
    "save_train_state",
    "single_process_megatron",
]
