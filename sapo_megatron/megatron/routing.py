"""The trainer's own MoE routing: capture each router's top-k expert indices during a forward pass, and compare
them with the routes a rollout engine reported (SGLang ``return_routed_experts``).

Routing agreement – the fraction of token-layers whose top-k *sets* are identical between engine and trainer –
is the metric the routing-replay literature (R2, R3) uses to quantify training–inference routing drift:
:func:`routing_agreement` on one sample's numpy routes, :func:`routing_agreement_by_layer` on ``[b, s, L, k]``
micro-batch tensors with a token mask, :func:`reduce_agreement` summed over ranks (``TrainEngine.routing_agreement``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter


class RoutingCapture:
    """Top-k indices per MoE layer of this rank's stage, in forward order: ``[b, s, k]`` int tensors."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.layers: list[torch.Tensor] = []

    def hook(self, module: TopKRouter, inputs, output) -> None:
        _probs, routing_map = output  # [s*b, E] bool, sequence-major like Megatron: the experts dispatched to
        indices = routing_map.detach().to(torch.int8).topk(module.topk, dim=-1).indices
        self.layers.append(indices.reshape(-1, self.batch_size, module.topk).transpose(0, 1).contiguous())


@contextlib.contextmanager
def capture_routing(model: torch.nn.Module, batch_size: int) -> Iterator[RoutingCapture]:
    """Record every ``TopKRouter``'s choice while the block runs (sequence parallelism: this rank's tokens)."""
    capture = RoutingCapture(batch_size)
    handles = [m.register_forward_hook(capture.hook) for m in model.modules() if isinstance(m, TopKRouter)]
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()


def routing_agreement(engine_routes: np.ndarray, trainer_routes: np.ndarray) -> float:
    """Fraction of ``(token, layer)`` rows whose top-k expert sets match; both ``[tokens, layers, k]``."""
    if engine_routes.shape != trainer_routes.shape:
        raise ValueError(f"route shapes differ: engine {engine_routes.shape}, trainer {trainer_routes.shape}")
    same = np.sort(engine_routes, axis=-1) == np.sort(trainer_routes, axis=-1)
    return float(same.all(axis=-1).mean())


def agreement_counts(
    routes_a: torch.Tensor, routes_b: torch.Tensor, mask: torch.Tensor, layers: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, float64 ``[L]``: how many token-layers have identical top-k *sets* in ``routes_a`` and
    ``routes_b`` (int ``[b, s, L, k]``), and how many were compared: positions where ``mask`` ([b, s]) > 0 and
    both hold a route (no ``-1``), restricted to ``layers`` when given."""
    if routes_a.shape != routes_b.shape or routes_a.shape[:2] != mask.shape:
        raise ValueError(
            f"route shapes differ: {list(routes_a.shape)} vs {list(routes_b.shape)}, mask {list(mask.shape)}"
        )
    sorted_a, sorted_b = routes_a.sort(dim=-1).values, routes_b.sort(dim=-1).values
    compared = (mask > 0)[..., None] & (sorted_a[..., 0] >= 0) & (sorted_b[..., 0] >= 0)  # [b, s, L]
    if layers is not None:
        wanted = torch.zeros(routes_a.shape[2], dtype=torch.bool)
        wanted[list(layers)] = True
        compared &= wanted
    same = (sorted_a == sorted_b).all(dim=-1) & compared
    return same.sum(dim=(0, 1)).double(), compared.sum(dim=(0, 1)).double()


def agreement_from_counts(matches: torch.Tensor, compared: torch.Tensor) -> tuple[float, list[float]]:
    """``(overall, per layer)`` fractions from :func:`agreement_counts`; NaN where nothing was compared."""
    total = float(compared.sum())
    overall = float(matches.sum()) / total if total else math.nan
    per_layer = [float(m) / float(c) if c else math.nan for m, c in zip(matches, compared)]
    return overall, per_layer


def routing_agreement_by_layer(
    routes_a: torch.Tensor, routes_b: torch.Tensor, mask: torch.Tensor
) -> tuple[float, list[float]]:
    """Routing agreement of two ``[b, s, L, k]`` route tensors over the token-layers ``mask`` [b, s] selects
    (e.g. ``loss_mask``: positions whose outputs are response log-probs): ``(overall, per layer)``; layers
    without routes (``-1``, dense) give NaN."""
    return agreement_from_counts(*agreement_counts(routes_a, routes_b, mask))


def reduce_agreement(
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    key_a: str,
    key_b: str,
    layers: Sequence[int],
    mask_key: str = "loss_mask",
) -> tuple[float, list[float]]:
    """:func:`routing_agreement_by_layer` over this rank's micro-batches and this stage's MoE ``layers``,
    summed over data-parallel ranks and pipeline stages (not tensor-parallel ones: they hold the same rows)."""
    counts = torch.zeros(2, micro_batches[0][key_a].shape[2], dtype=torch.float64)
    for batch in micro_batches:
        counts += torch.stack(agreement_counts(batch[key_a], batch[key_b], batch[mask_key], layers))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    counts = counts.to(device or "cpu")
    dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(counts, group=parallel_state.get_pipeline_model_parallel_group())
    return agreement_from_counts(*counts.cpu())
