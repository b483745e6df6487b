"""Move weights between a (TP/PP/EP-sharded) Megatron model and HF-named full tensors, through the mapping table.

Megatron's parameter names are rank-local: ``decoder.layers.{l}`` counts this pipeline stage's layers and
``local_experts.{e}`` this expert-parallel rank's experts. :func:`local_params` names every parameter globally
and says which tensor-parallel slice the rank holds; the rest is the table in
:mod:`sapo_megatron.checkpoint.mapping`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from sapo_megatron.checkpoint.mapping import MappingError, Resolved, ShardInfo, hf_expected_shapes, resolve
from sapo_megatron.model.arch import QwenArch

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
VISION_PREFIX = "visual."  # a vision-language model's tower (Megatron names), ...
VISION_HF_PREFIX = "model.visual."  # ... and its HF names
_EXPERT = re.compile(r"(local_experts\.|linear_fc[12]\.weight)(\d+)")


@dataclass(frozen=True)
class LocalParam:
    """One parameter of this rank, named globally."""

    local_name: str
    param: torch.Tensor
    resolved: Resolved
    shard: ShardInfo

    @property
    def is_expert(self) -> bool:
        return self.resolved.rule.expert


def unwrap(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while isinstance(inner := getattr(model, "module", None), torch.nn.Module):
        model = inner
    return model


def local_params(model: torch.nn.Module) -> list[LocalParam]:
    """Every parameter of this rank, with global layer/expert indices and its TP shard."""
    gpt = unwrap(model)
    layer_offset = _layer_offset(gpt)
    num_local_experts = _num_local_experts(gpt)
    expert_offset = parallel_state.get_expert_model_parallel_rank() * num_local_experts
    dense = ShardInfo(
        parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    )
    expert = ShardInfo(
        parallel_state.get_expert_tensor_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_rank(),
    )
    arch = getattr(gpt, "arch", None)  # a vision-language model names its HF tensors differently
    out = []
    for name, param in gpt.named_parameters():
        global_name = _globalise(name, layer_offset, expert_offset)
        resolved = resolve(global_name, arch)
        out.append(LocalParam(name, param, resolved, expert if resolved.rule.expert else dense))
    return out


def _layer_offset(gpt: torch.nn.Module) -> int:
    layers = getattr(getattr(gpt, "decoder", None), "layers", None)
    return layers[0].layer_number - 1 if layers else 0


def _num_local_experts(gpt: torch.nn.Module) -> int:
    for module in gpt.modules():
        count = getattr(module, "num_local_experts", None)
        if count is not None:
            return int(count)
    return 0


def _globalise(name: str, layer_offset: int, expert_offset: int) -> str:
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name, count=1)
    if ".experts." in name:
        name = _EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + expert_offset}", name, count=1)
    return name


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, get_tensor: Callable[[str], torch.Tensor], arch: QwenArch) -> int:
    """Copy HF-named full tensors into this rank's shards; ``get_tensor(name)`` may read lazily from disk.

    Returns the number of parameters written. Raises :class:`MappingError` naming the tensor on a missing name
    or a shape that does not fit.
    """
    for item in local_params(model):
        hf = [get_tensor(name) for name in item.resolved.hf_names]
        local = item.resolved.rule.transform.to_local(hf, item.shard, arch)
        if tuple(local.shape) != tuple(item.param.shape):
            raise MappingError(
                f"{item.resolved.megatron_name} (from {', '.join(item.resolved.hf_names)}): expected local shape "
                f"{tuple(item.param.shape)}, the HF tensors give {tuple(local.shape)}"
            )
        item.param.copy_(local.to(item.param.dtype))
    return len(local_params(model))


def _gather_fn(expert: bool) -> Callable[[torch.Tensor, int], torch.Tensor]:
    group = (
        parallel_state.get_expert_tensor_parallel_group()
        if expert
        else parallel_state.get_tensor_model_parallel_group()
    )

    def gather(local: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    return gather


@torch.no_grad()
def iter_hf_weights(
    model: torch.nn.Module, arch: QwenArch, *, owned_only: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the parameters of this rank's pipeline stage and expert shard.

    Every rank of a tensor-parallel group must iterate together (the TP gathers are collectives). With
    ``owned_only`` a rank yields only the tensors it publishes (:func:`owns_export`), so that across all ranks
    every HF tensor is yielded exactly once; the others still take part in the gathers.
    """
    for item in local_params(model):
        transform = item.resolved.rule.transform
        full_list = transform.to_hf(
            item.param.detach(), _gather_fn(item.is_expert), item.shard, arch, len(item.resolved.hf_names)
        )
        if owned_only and not owns_export(item.is_expert):
            continue
        yield from zip(item.resolved.hf_names, full_list)


def owns_export(item_is_expert: bool) -> bool:
    """Whether this rank is the one that publishes a gathered tensor (first TP rank of the first DP replica)."""
    if item_is_expert:
        return (
            parallel_state.get_expert_tensor_parallel_rank() == 0
            and parallel_state.get_expert_data_parallel_rank() == 0
        )
    return (  # CP ranks hold the same weights: only the first publishes
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    )


@dataclass(frozen=True)
class _ExportUnit:
    """One Megatron parameter as published: its HF tensors and the global rank that owns the full copy."""

    megatron_name: str
    hf_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    expert: bool
    owner: int

    @property
    def nbytes(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(_numel(shape) * size for shape in self.shapes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _export_units(
    params: list[LocalParam], arch: QwenArch, *, skip_vision: bool = False
) -> list[_ExportUnit]:
    """Every published parameter of the whole model, in HF order, identical on all ranks (one all-gather of
    names). Raises :class:`MappingError` unless every HF tensor of the architecture (but a skipped vision tower)
    is published once."""
    expected = hf_expected_shapes(arch)
    if skip_vision:
        expected = {n: s for n, s in expected.items() if not n.startswith(VISION_HF_PREFIX)}
    mine = [
        (
            p.resolved.megatron_name,
            p.resolved.hf_names,
            str(p.param.dtype).removeprefix("torch."),
            p.is_expert,
        )
        for p in params
        if owns_export(p.is_expert)
    ]
    gathered: list[list] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    order = {name: i for i, name in enumerate(expected)}
    units: list[_ExportUnit] = []
    seen: dict[str, int] = {}
    for rank, owned in enumerate(gathered):
        for megatron_name, hf_names, dtype, expert in owned:
            for name in hf_names:
                if name in seen:
                    raise MappingError(f"{name} is published by ranks {seen[name]} and {rank}")
                seen[name] = rank
            shapes = tuple(expected[n] for n in hf_names)
            units.append(_ExportUnit(megatron_name, hf_names, shapes, getattr(torch, dtype), expert, rank))
    missing = sorted(set(expected) - set(seen), key=order.__getitem__)
    if missing:
        raise MappingError(f"no rank publishes {len(missing)} HF tensors, e.g. {', '.join(missing[:5])}")
    return sorted(units, key=lambda u: order[u.hf_names[0]])


def _split_buckets(units: list[_ExportUnit], bucket_bytes: int) -> list[list[_ExportUnit]]:
    buckets: list[list[_ExportUnit]] = [[]]
    size = 0
    for unit in units:
        if buckets[-1] and size + unit.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(unit)
        size += unit.nbytes
    return buckets


def _as_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _from_bytes(flat: torch.Tensor, units: list[_ExportUnit]) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for unit in units:
        size = torch.empty((), dtype=unit.dtype).element_size()
        for name, shape in zip(unit.hf_names, unit.shapes):
            nbytes = _numel(shape) * size
            out.append((name, flat[offset : offset + nbytes].view(unit.dtype).reshape(shape).clone()))
            offset += nbytes
    return out


def stage_sources() -> list[int]:
    """Collective: per pipeline stage, the global rank that collects that stage's weights for a per-stage
    weight sync (its first tensor-parallel rank of the first data-parallel replica: it owns the stage's dense
    weights, so only expert shards travel to it)."""
    coords = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )
    gathered: list[tuple[int, int, int]] = [(0, 0, 0)] * dist.get_world_size()
    dist.all_gather_object(gathered, coords)
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    return [
        min(r for r, (pp, tp, dp) in enumerate(gathered) if pp == s and tp == 0 and dp == 0)
        for s in range(stages)
    ]


@torch.no_grad()
def iter_hf_buckets(
    model: torch.nn.Module,
    arch: QwenArch,
    bucket_bytes: int,
    dst: int = 0,
    *,
    all_ranks: bool = False,
    per_stage: bool = False,
    include_frozen: bool = False,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full HF-named tensors of a TP/PP/EP-sharded model in buckets of at most ``bucket_bytes`` (a larger
    tensor gets a bucket of its own), delivered on global rank ``dst`` (on every rank with ``all_ranks``).

    With ``per_stage``, each pipeline stage delivers only its own layers' tensors, on its source rank
    (:func:`stage_sources`; ``dst`` is ignored), so no rank ever holds more than one bucket of another stage's
    or another expert rank's weights; stages proceed independently and may yield different bucket counts.

    A frozen vision tower (``model.freeze_vision``) never changes, so weight sync leaves it out unless
    ``include_frozen`` (a whole checkpoint written to disk needs it).

    Every rank must exhaust the iterator: all ranks (of a stage, with ``per_stage``) yield the same number of
    buckets, empty lists where nothing is delivered. Each HF tensor appears exactly once, in HF order.

    Collective order (why it cannot deadlock): the bucket plan is identical on all ranks (one
    ``all_gather_object`` of names), and every rank walks it in the same order. Within a bucket, the
    tensor-parallel gathers of a parameter involve only the TP (expert-TP) group of its owner; all members
    of that group hold it and reach it in the same order. Then each owner makes one ``send`` of its
    bytes to ``dst`` while ``dst`` receives from the owners in ascending rank order; nobody starts the next
    bucket's gathers before its own sends complete, so no rank waits on a rank that waits on it.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    params = local_params(model)
    skip_vision = not include_frozen and bool(getattr(unwrap(model), "freeze_vision", False))
    if skip_vision:
        params = [p for p in params if not p.local_name.startswith(VISION_PREFIX)]
    units = _export_units(params, arch, skip_vision=skip_vision)
    me = dist.get_rank()
    if per_stage:
        sources, stage_of_rank = stage_sources(), _stage_of_ranks()
        my_stage = stage_of_rank[me]
        units = [u for u in units if stage_of_rank[u.owner] == my_stage]
        dst = sources[my_stage]
    by_name = {p.resolved.megatron_name: p for p in params}
    group_ranks = {
        False: set(dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())),
        True: set(dist.get_process_group_ranks(parallel_state.get_expert_tensor_parallel_group())),
    }
    device = next(iter(by_name.values())).param.device if by_name else torch.device("cpu")
    for bucket in _split_buckets(units, bucket_bytes):
        produced: list[torch.Tensor] = []
        for unit in bucket:
            item = by_name.get(unit.megatron_name)
            if item is None or unit.owner not in group_ranks[unit.expert]:
                continue  # this rank's TP group does not hold the owner's copy
            full = item.resolved.rule.transform.to_hf(
                item.param.detach(), _gather_fn(item.is_expert), item.shard, arch, len(unit.hf_names)
            )
            if unit.owner == me:
                produced += [t.to(unit.dtype) for t in full]
        yield _deliver(bucket, produced, me, dst, device, all_ranks)


def _stage_of_ranks() -> list[int]:
    """Collective: the pipeline stage of every global rank."""
    gathered: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(gathered, parallel_state.get_pipeline_model_parallel_rank())
    return gathered


def _deliver(
    bucket: list[_ExportUnit],
    produced: list[torch.Tensor],
    me: int,
    dst: int,
    device: torch.device,
    all_ranks: bool,
) -> list[tuple[str, torch.Tensor]]:
    """Move each owner's tensors of one bucket to ``dst`` (point-to-point), optionally broadcast them."""
    owners = sorted({u.owner for u in bucket})
    if me != dst and me in owners:
        dist.send(_as_bytes(produced).to(device), dst)
    flat = None
    if me == dst:
        parts = {}
        for owner in owners:
            if owner == me:
                parts[owner] = _as_bytes(produced).to(device)
                continue
            size = sum(u.nbytes for u in bucket if u.owner == owner)
            parts[owner] = torch.empty(size, dtype=torch.uint8, device=device)
            dist.recv(parts[owner], owner)
        # reorder the owners' byte runs into bucket (HF) order
        cursor = dict.fromkeys(owners, 0)
        pieces = []
        for unit in bucket:
            start = cursor[unit.owner]
            cursor[unit.owner] = start + unit.nbytes
            pieces.append(parts[unit.owner][start : start + unit.nbytes])
        flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)
    if all_ranks:
        if flat is None:
            flat = torch.empty(sum(u.nbytes for u in bucket), dtype=torch.uint8, device=device)
        dist.broadcast(flat, dst)
    return _from_bytes(flat, bucket) if flat is not None else []


__all__ = [
    "LocalParam",
    "MappingError",
    "iter_hf_buckets",
    "iter_hf_weights",
    "load_hf_weights",
    "local_params",
    "owns_export",
    "stage_sources",
]
