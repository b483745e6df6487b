"""Per-token values of one RL step pooled over the data-parallel ranks (for statistics that sums cannot carry,
such as the quantiles of the token ratios): identical on every rank afterwards."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def gather_token_values(local: Sequence[torch.Tensor]) -> torch.Tensor:
    """1-d fp32 CPU tensor: this step's values from the last pipeline stage of every data-parallel rank, once each
    (tensor-parallel copies hold the same tokens and are not repeated). Collective on every rank; without Megatron's
    parallel state, just ``local`` concatenated."""
    values = torch.cat([v.detach().float().reshape(-1) for v in local]) if local else torch.zeros(0)
    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return values.cpu()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    values = _all_gather(values.to(device), parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        values = _from_last_stage(values)
    return values.cpu()


def _all_gather(values: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return values
    size = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    parts = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[: int(s.item())] for part, s in zip(parts, sizes)])


def _from_last_stage(values: torch.Tensor) -> torch.Tensor:
    group = parallel_state.get_pipeline_model_parallel_group()
    src = parallel_state.get_pipeline_model_parallel_last_rank()
    size = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    dist.broadcast(size, src=src, group=group)
    if not parallel_state.is_pipeline_last_stage():
        values = torch.zeros(int(size.item()), dtype=values.dtype, device=values.device)
    dist.broadcast(values, src=src, group=group)
    return values
