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

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from sapo_megatron.arch import QwenArch
from sapo_megatron.checkpoint.mapping import MappingError, Resolved, ShardInfo, resolve

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
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


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
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
    out = []
    for name, param in gpt.named_parameters():
        global_name = _globalise(name, layer_offset, expert_offset)
        resolved = resolve(global_name)
        out.append(LocalParam(name, param, resolved, expert if resolved.rule.expert else dense))
    return out


def _layer_offset(gpt: torch.nn.Module) -> int:
    layers = getattr(getattr(gpt, "decoder", None), "layers", None)
    return layers[0].layer_number - 1 if layers else 0


def _num_local_experts(gpt: torch.nn.Module) -> int:
    for module in gpt.modules():
        if hasattr(module, "num_local_experts"):
            return int(module.num_local_experts)
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
    return (
        parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0
    )


__all__ = ["LocalParam", "MappingError", "iter_hf_weights", "load_hf_weights", "local_params", "owns_export"]
