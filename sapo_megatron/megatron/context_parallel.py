"""Context parallelism (``parallel.cp > 1``): which tokens of a micro-batch each CP rank holds, and the gathers
that put per-token values back in sequence order.

Chunking (Megatron-Core's ``utils.get_batch_on_this_cp_rank`` for padded rows, Transformer Engine's
``thd_get_partitioned_indices`` for packed THD rows): every *segment* – a padded row as a whole, or each slot of a
packed row (where ``position_ids`` restart at 0) – is cut into ``2·cp`` equal chunks and CP rank ``i`` holds chunks
``i`` and ``2·cp − 1 − i``, so that every rank gets the same share of causal attention work. Segment lengths must
be multiples of ``2·cp`` (``config.sequence_length_multiple`` rounds padded rows and packed slots up to it).

Every CP rank of a data-parallel rank gets the same micro-batches (whole sequences). The model runs on the rank's
chunks (:func:`shard_tokens`); the loss hooks compute log-probs and entropy on the local logits, then
:func:`gather_tokens` puts them back in sequence order on every CP rank, so that sequence sums, token counts,
sequence-level ratios (GSPO, SAPO's sequence variant) and every aggregation mode see whole sequences. The
gather's backward hands each rank the gradient of its own tokens only: every CP rank computes the same loss, and
each back-propagates through its own logits; Megatron's DDP then sums the gradients over data × context parallel
ranks (``intra_dp_cp_group``, scaled by ``1 / (dp·cp)``), and Megatron's schedule multiplies a 2-tuple loss by
``cp``: the two cancel (megatron-core 0.16.1 ``schedules.forward_step_calc_loss``).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_config import TransformerConfig

from sapo_megatron.model.packing import POSITION_IDS, is_packed


def cp_size_rank() -> tuple[int, int]:
    """``(cp size, cp rank)`` from Megatron's parallel state; ``(1, 0)`` without one."""
    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()


def segment_chunk_indices(bounds: list[int], cp: int, rank: int) -> torch.Tensor:
    """int64 positions CP ``rank`` holds, in its local order: for each segment ``[bounds[j], bounds[j+1])``, chunk
    ``rank`` then chunk ``2·cp − 1 − rank`` of its ``2·cp`` equal chunks."""
    parts = []
    for start, end in itertools.pairwise(bounds):
        length = end - start
        if length % (2 * cp):
            raise ValueError(
                f"context parallelism: a segment of {length} tokens is not a multiple of 2·cp = {2 * cp}; "
                "pad sequences to sequence_length_multiple(cfg)"
            )
        chunk = length // (2 * cp)
        for index in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class TokenShards:
    """The CP split of one micro-batch's sequence axis: ``local`` (this rank's positions, ``[s/cp]``) and
    ``gathered`` (every rank's positions in rank order, ``[s]``: the order :func:`gather_tokens` receives)."""

    cp: int
    rank: int
    local: torch.Tensor
    gathered: torch.Tensor


def token_shards(batch: Mapping[str, torch.Tensor], cp: int, rank: int) -> TokenShards:
    """The CP split of ``batch``'s sequence axis: a padded row is one segment, a packed row one per slot."""
    length = int(batch["input_ids"].shape[1])
    bounds = [0, length]
    if is_packed(batch):
        row = batch[POSITION_IDS][0].cpu()
        bounds = [*(row == 0).nonzero().squeeze(1).tolist(), length]
    per_rank = [segment_chunk_indices(bounds, cp, r) for r in range(cp)]
    return TokenShards(cp, rank, per_rank[rank], torch.cat(per_rank))


def batch_shards(batch: Mapping[str, torch.Tensor]) -> TokenShards | None:
    """This rank's :class:`TokenShards` of ``batch`` under Megatron's CP group; ``None`` at cp 1."""
    cp, rank = cp_size_rank()
    return token_shards(batch, cp, rank) if cp > 1 else None


def shard_tokens(x_bs: torch.Tensor, shards: TokenShards | None) -> torch.Tensor:
    """``x [b, s, ...]`` → this rank's positions ``[b, s/cp, ...]`` (``x`` itself at cp 1)."""
    return x_bs if shards is None else x_bs[:, shards.local.to(x_bs.device)]


def _all_gather_seq(x_bs: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(x_bs) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x_bs.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class _GatherTokens(torch.autograd.Function):
    """All-gather ``[b, s/cp, ...]`` over CP into sequence order; backward: this rank's positions of the
    gradient (every CP rank computes the same loss from the gathered values)."""

    @staticmethod
    def forward(ctx, x_bs, gathered, local, group):
        ctx.save_for_backward(local)
        out = torch.empty(
            (x_bs.shape[0], gathered.numel(), *x_bs.shape[2:]), dtype=x_bs.dtype, device=x_bs.device
        )
        out[:, gathered.to(x_bs.device)] = _all_gather_seq(x_bs, group)
        return out

    @staticmethod
    def backward(ctx, grad_bs):
        (local,) = ctx.saved_tensors
        return grad_bs[:, local.to(grad_bs.device)], None, None, None


def gather_tokens(x_bs: torch.Tensor, shards: TokenShards | None) -> torch.Tensor:
    """This rank's per-token values ``[b, s/cp, ...]`` → the whole sequences ``[b, s, ...]`` in sequence order on
    every CP rank (differentiable, see :class:`_GatherTokens`); ``x`` itself at cp 1."""
    if shards is None:
        return x_bs
    group = parallel_state.get_context_parallel_group()
    return _GatherTokens.apply(x_bs, shards.gathered, shards.local, group)


def causal_mask(batch: Mapping[str, torch.Tensor], shards: TokenShards) -> torch.Tensor:
    """bool ``[b, 1, s/cp, s]``, True where a local query must not see a key: keys in :attr:`TokenShards.gathered`
    order (the order the CP attention all-gathers K/V in); another segment (packed), or a later position."""
    ids = batch["input_ids"]
    if is_packed(batch):
        segment = (batch[POSITION_IDS] == 0).cumsum(dim=-1).cpu()
    else:
        segment = torch.zeros(ids.shape, dtype=torch.long)
    query, key = shards.local, shards.gathered
    same = segment[:, query, None] == segment[:, None, key]
    allowed = same & (key[None, None, :] <= query[None, :, None])
    return (~allowed)[:, None].to(ids.device)


class _GatherKeyValue(torch.autograd.Function):
    """All-gather ``[s/cp, b, g, d]`` keys or values over CP, in rank order; backward: the sum over CP ranks of the
    gradient (every rank's queries read every key), this rank's rows – a reduce-scatter, written as all-reduce +
    slice because gloo has no reduce-scatter."""

    @staticmethod
    def forward(ctx, x_sbgd, group):
        ctx.group = group
        parts = [torch.empty_like(x_sbgd) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x_sbgd.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad_sbgd):
        grad = grad_sbgd.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rows = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * rows : (rank + 1) * rows], None


class ContextParallelAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention`` under context parallelism: the CPU stand-in for Transformer
    Engine's ``TEDotProductAttention`` with ``cp_comm_type="all_gather"`` (what runs on GPUs).

    Keys and values are all-gathered over the CP group (autograd-correct: the backward reduce-scatters their
    gradients), queries stay local, and the attention over the gathered keys uses the mask of
    :func:`causal_mask` (exact causal – and per-segment for packed rows – attention at the tokens' global
    positions). Megatron's class refuses ``context_parallel_size > 1`` in its constructor (megatron-core 0.16.1,
    ``transformer/dot_product_attention.py``); it is built here from a copy of the config at cp 1, since nothing
    else in it depends on CP. Memory: the scores are ``[b, heads, s/cp, s]`` per rank, ``1/cp`` of cp 1's."""

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        local = copy.copy(config)
        local.context_parallel_size = 1
        super().__init__(local, *args, **kwargs)
        self.config = config

    def forward(self, query, key, value, attention_mask, *args: Any, **kwargs: Any):
        if attention_mask is None:
            raise ValueError("context-parallel attention needs the mask of context_parallel.causal_mask")
        group = parallel_state.get_context_parallel_group()
        key = _GatherKeyValue.apply(key, group)
        value = _GatherKeyValue.apply(value, group)
        return super().forward(query, key, value, attention_mask, *args, **kwargs)


def with_context_parallel_attention(spec: Any) -> Any:
    """A copy of a local layer spec (one ``ModuleSpec`` or a block's ``layer_specs``) whose self-attention uses
    :class:`ContextParallelAttention`."""
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(
            spec, layer_specs=[with_context_parallel_attention(layer) for layer in spec.layer_specs]
        )
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(attention.submodules, core_attention=ContextParallelAttention),
    )
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention)
    )
