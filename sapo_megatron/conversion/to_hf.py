"""Megatron → HF: a Megatron torch_dist checkpoint (saved under any layout) as HF safetensors shards.

Parameters are read batch by batch (regions of the global tensors, so any saved layout works) and streamed
into size-bounded safetensors shards; the output is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sapo_megatron.checkpoint import atomic, fused_experts
from sapo_megatron.checkpoint.safetensors_stream import (
    TensorSpec,
    plan_shards,
    write_index,
    write_shard,
)
from sapo_megatron.conversion.params import (
    TOKENIZER_FILES,
    ConversionError,
    ParamPlan,
    checkpoint_hf_config,
    itemsize,
    numel,
    plan_params,
    progress_bar,
)
from sapo_megatron.model.arch import ArchError, QwenArch

if TYPE_CHECKING:
    from tqdm import tqdm

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
DEFAULT_READ_BATCH_BYTES = 512 * 1024**2


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
    raw_config = checkpoint_hf_config(path, hf_reference)
    try:
        arch = QwenArch.from_hf_dict(raw_config)
    except (ArchError, ValueError) as err:
        raise ConversionError(f"HF config of {path}: {err}") from err
    from sapo_megatron.megatron import dist_ckpt  # after the input checks: importing Megatron takes seconds

    with dist_ckpt.single_process_megatron():
        layout = dist_ckpt.reference_layout(dist_ckpt.build_meta_model(arch))
        plans = plan_params(layout, arch)
        source = MegatronSource(path, plans, arch, dist_ckpt.checkpoint_tensor_dtypes(path))
        _check_keys(source)
        out_dtype = _output_dtype(dtype, source)
        specs = _hf_specs(plans, arch, out_dtype)
        groups = fused_experts.fused_groups({s.name: s.shape for s in specs}) if arch.is_vl else []
        if groups:  # Qwen3-VL-MoE: experts stored fused, in the hub layout (what SGLang 0.5.23 loads)
            fused = fused_experts.fuse_specs([(s.name, s.shape) for s in specs])
            specs = [TensorSpec(name, shape, out_dtype) for name, shape in fused]
        shards = plan_shards(specs, max_shard_bytes)
        tmp = atomic.prepare_output_dir(out_dir, force=force)
        try:
            bar = progress_bar(sum(s.nbytes for s in specs), "megatron→hf", progress)
            stream = _hf_tensor_stream(source, out_dtype, read_batch_bytes, bar)
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


@dataclass(frozen=True)
class MegatronSource:
    """A Megatron checkpoint to export: its folder, the plan of its parameters, the architecture and the
    stored dtype of every global key."""

    path: Path
    plans: Sequence[ParamPlan]
    arch: QwenArch
    dtypes: dict[str, torch.dtype]


def _check_keys(source: MegatronSource) -> None:
    missing = sorted({c.key for p in source.plans for c in p.layout.chunks if c.key not in source.dtypes})
    if missing:
        raise ConversionError(
            f"checkpoint {source.path} lacks {len(missing)} tensors this architecture needs, e.g. "
            + ", ".join(missing[:5])
            + f"; is its {atomic.HF_CONFIG} the right one?"
        )


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _output_dtype(name: str | None, source: MegatronSource) -> torch.dtype:
    if name is not None:
        if name not in _DTYPES:
            raise ConversionError(f"dtype {name!r} is not one of {', '.join(_DTYPES)}")
        return _DTYPES[name]
    embedding = next(p for p in source.plans if p.name == "embedding.word_embeddings.weight")
    return source.dtypes[embedding.layout.chunks[0].key]


def _hf_specs(plans: Sequence[ParamPlan], arch: QwenArch, dtype: torch.dtype) -> list[TensorSpec]:
    specs = []
    for plan in plans:
        full = torch.empty(plan.layout.shape, device="meta")
        parts = plan.transform.split_full(full, arch, len(plan.hf_names))
        specs += [TensorSpec(n, tuple(t.shape), dtype) for n, t in zip(plan.hf_names, parts)]
    return specs


def _batches(
    plans: Sequence[ParamPlan], batch_bytes: int, dtypes: dict[str, torch.dtype]
) -> list[list[ParamPlan]]:
    batches: list[list[ParamPlan]] = [[]]
    size = 0
    for plan in plans:
        nbytes = numel(plan.layout.shape) * itemsize(dtypes[plan.layout.chunks[0].key])
        if batches[-1] and size + nbytes > batch_bytes:
            batches.append([])
            size = 0
        batches[-1].append(plan)
        size += nbytes
    return batches


def _hf_tensor_stream(
    source: MegatronSource, out_dtype: torch.dtype, batch_bytes: int, bar: tqdm
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors in plan order; the next batch is read by a helper thread while this one is written."""
    from sapo_megatron.megatron import dist_ckpt

    batches = _batches(source.plans, batch_bytes, source.dtypes)

    def read(batch: list[ParamPlan]) -> dict[str, torch.Tensor]:
        return dist_ckpt.read_params(source.path, [p.layout for p in batch], source.dtypes)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mcore2hf") as pool:
        pending = pool.submit(read, batches[0])  # _batches gives at least one (maybe empty) batch
        for i, batch in enumerate(batches):
            loaded = pending.result()
            if i + 1 < len(batches):
                pending = pool.submit(read, batches[i + 1])
            for plan in batch:
                full = loaded.pop(plan.name)
                parts = plan.transform.split_full(full, source.arch, len(plan.hf_names))
                for name, tensor in zip(plan.hf_names, parts):
                    bar.update(tensor.numel() * tensor.element_size())
                    yield name, tensor.to(out_dtype)


def _copy_tokenizer(hf_reference: str | Path | None, out: Path) -> None:
    if hf_reference is None:
        return
    for name in TOKENIZER_FILES:
        source = Path(hf_reference) / name
        if source.is_file():
            shutil.copyfile(source, out / name)
