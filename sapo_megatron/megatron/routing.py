"""The trainer's own MoE routing: capture each router's top-k expert indices during a forward pass, and compare
them with the routes a rollout engine reported (SGLang ``return_routed_experts``).

Routing agreement – the fraction of token-layers whose top-k *sets* are identical between engine and trainer –
is the metric the routing-replay literature (R2, R3) uses to quantify training–inference routing drift.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter


class RoutingCapture:
    """Top-k indices per MoE layer of this rank's stage, in forward order: ``[b, s, k]`` int tensors."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.layers: list[torch.Tensor] = []

    def hook(self, module: TopKRouter, inputs, output) -> None:
        probs, _routing_map = output
        k = module.topk
        indices = probs.detach().float().topk(k, dim=-1).indices  # [s*b, k], sequence-major like Megatron
        self.layers.append(indices.reshape(-1, self.batch_size, k).transpose(0, 1).contiguous())


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
