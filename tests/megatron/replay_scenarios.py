"""Per-rank bodies of the routing-replay tests (imported by spawned workers).

The routing a router *used* is observed independently of ``RouterReplay``: a forward hook on every ``TopKRouter``
reads the ``routing_map`` it returned (the experts the dispatcher sends each token to) – in the forward and again
in any recomputation during the backward.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay

from sapo_megatron.batching import RouteLayout, TrainSequence, build_micro_batches
from sapo_megatron.megatron.loss_hook import LogprobOutput
from sapo_megatron.megatron.parallel import data_parallel_group, init_parallel, rank_info
from sapo_megatron.megatron.routing import agreement_counts, agreement_from_counts
from sapo_megatron.megatron.sft import sft_loss
from sapo_megatron.megatron.train_step import MicroBatch, TrainEngine
from tests.megatron.scenarios import layout_config


class RouteSpy:
    """Every router call of this rank, per global layer (0-based): the router's input and the experts it used,
    ``[b, s_local, k]`` sorted. A recomputation in the backward sees the very input of its forward."""

    def __init__(self, module: torch.nn.Module, batch_size: int) -> None:
        self.batch_size = batch_size
        self.calls: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._handles = []
        for layer in module.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if isinstance(router, TopKRouter):
                self.calls[layer.layer_number - 1] = []
                self._handles.append(router.register_forward_hook(self._hook(layer.layer_number - 1)))

    def _hook(self, layer: int):
        def hook(module, inputs, output) -> None:
            routing_map = output[1].detach()  # [s_local * b, E] bool, sequence-major
            indices = routing_map.to(torch.int8).topk(module.topk, dim=-1).indices.sort(-1).values
            used = indices.reshape(-1, self.batch_size, module.topk).transpose(0, 1).cpu()
            self.calls[layer].append((inputs[0].detach().clone().cpu(), used))

        return hook

    def take(self) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        calls, self.calls = self.calls, {layer: [] for layer in self.calls}
        return calls

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def local_slice(routes: torch.Tensor, layer: int) -> torch.Tensor:
    """What a router of ``layer`` on this tensor-parallel rank must use: its sequence slice, sorted [b, s/tp, k]."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    part = routes.shape[1] // tp
    return routes[:, rank * part : (rank + 1) * part, layer].long().sort(-1).values


def match_calls(
    calls: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], sources: list[torch.Tensor]
) -> dict:
    """Check every router call against the routes its micro-batch should use.

    Calls are grouped by router input: a forward and the recomputations of the same micro-batch see the same
    input, and forwards run in micro-batch order, so the i-th distinct input is micro-batch i. Returns per layer
    ``[calls in group i]`` and, over all calls, the smallest fraction of token rows equal to micro-batch i's
    routes (1.0: every call used exactly its own micro-batch's routes)."""
    sizes, worst = {}, 1.0
    for layer, layer_calls in calls.items():
        groups: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        for inputs, used in layer_calls:
            group = next((g for g in groups if torch.equal(g[0], inputs)), None)
            if group is None:
                group = (inputs, [])
                groups.append(group)
            group[1].append(used)
        sizes[layer] = [len(used_list) for _, used_list in groups]
        for index, (_, used_list) in enumerate(groups[: len(sources)]):
            expected = local_slice(sources[index], layer)
            for used in used_list:
                worst = min(worst, float((used == expected).all(-1).float().mean()))
    return {"calls_per_micro_batch": sizes, "worst_row_agreement": worst}


def tiny_sequences(layout: RouteLayout, count: int, seed: int) -> list[TrainSequence]:
    """Sequences of varied lengths with random valid routes (distinct experts per row)."""
    gen = np.random.default_rng(seed)
    out = []
    for i in range(count):
        prompt = gen.integers(1, 60, size=int(gen.integers(3, 9))).tolist()
        response = gen.integers(1, 60, size=int(gen.integers(2, 12))).tolist()
        rows = len(prompt) + len(response) - 1
        routes = np.argsort(gen.random((rows, layout.num_layers, layout.num_experts)), axis=-1)[
            ..., : layout.top_k
        ]
        out.append(
            TrainSequence(
                prompt, response, advantage=1.0, routed_experts=routes.astype(np.int32), sample_id=f"s{i}"
            )
        )
    return out


def add_normaliser(micro: list[MicroBatch]) -> list[MicroBatch]:
    total = sum(batch["loss_mask"].sum() for batch in micro).double().reshape(1)
    dist.all_reduce(total, group=data_parallel_group())
    for batch in micro:
        batch["num_tokens_global"] = total.float()[0]
    return micro


def perturb_routers(module: torch.nn.Module, scale: float) -> None:
    """Add the same seeded noise (per global layer) to every router weight on every rank: live routing moves."""
    for layer in module.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if isinstance(router, TopKRouter):
            gen = torch.Generator().manual_seed(1000 + layer.layer_number)
            noise = torch.randn(router.weight.shape, generator=gen)
            with torch.no_grad():
                router.weight.add_(noise.to(router.weight) * scale)


def enable_moe_recompute(module: torch.nn.Module) -> int:
    """What ``recompute_granularity='selective'`` + ``recompute_modules=['moe']`` sets on each MoE layer: the
    layer's forward runs under ``tensor_parallel.checkpoint`` and is recomputed in the backward."""
    layers = [layer.mlp for layer in module.decoder.layers if hasattr(layer.mlp, "moe_layer_recompute")]
    for mlp in layers:
        mlp.moe_layer_recompute = True
    return len(layers)


def replay_state_left(engine: TrainEngine) -> bool:
    """Does any RouterReplay of the process (this engine's, via the global list) hold anything?"""
    return engine.routes.holds_state() or any(
        r.target_topk_idx is not None
        or r.recorded_topk_idx is not None
        or r.replay_backward_list
        or r.router_replay_action is not None
        for r in RouterReplay.global_router_replay_instances
    )


def agreement(micro: list[MicroBatch], key_a: str, key_b: str, layers: list[int]) -> float:
    counts = torch.zeros(2, micro[0][key_a].shape[2], dtype=torch.float64)
    for batch in micro:
        counts += torch.stack(
            agreement_counts(batch[key_a], batch[key_b], torch.ones(batch[key_a].shape[:2]), layers)
        )
    return agreement_from_counts(*counts)[0]


def replay_layouts(payload: dict[str, Any]) -> dict[str, Any]:
    """Record (R2) → perturb → replay recorded → replay engine routes (R3), observing every router call."""
    cfg = layout_config(payload)
    init_parallel(cfg.parallel, seed=0, cfg=cfg)
    info = rank_info()
    engine = TrainEngine(cfg, routing_replay=True, total_steps=4)
    recompute_layers = enable_moe_recompute(engine.module) if payload.get("recompute") else 0
    layout = RouteLayout.from_arch(cfg.model.arch)
    par = cfg.parallel
    micro = build_micro_batches(
        tiny_sequences(layout, payload["sequences"], seed=5),
        dp_rank=info.dp_rank,
        dp_size=info.dp_size,
        micro_batches=par.micro_batches,
        pad_id=0,
        length_multiple=par.tp if par.sequence_parallel else 1,
        route_layout=layout,
    )
    add_normaliser(micro)
    spy = RouteSpy(engine.module, micro[0]["input_ids"].shape[0])
    result: dict[str, Any] = {"layers": engine.routes.layers, "recompute_layers": recompute_layers}

    # R2 record: the recorded routes are what the routers used in that pass
    engine.forward_only(micro, LogprobOutput(), record_routes=True)
    result["record"] = match_calls(spy.take(), [b["recorded_routes"] for b in micro])
    result["leak_after_record"] = replay_state_left(engine)
    result["recorded_other_layers"] = sorted(
        {
            int(v)
            for b in micro
            for layer in range(layout.num_layers)
            if layer not in engine.routes.layers
            for v in b["recorded_routes"][:, :, layer].unique()
        }
    )

    # perturb the routers: live routing now differs from the recorded one
    perturb_routers(engine.module, payload.get("perturb", 0.5))
    live = [dict(b) for b in micro]
    engine.forward_only(live, LogprobOutput(), record_routes=True)
    spy.take()
    for batch, live_batch in zip(micro, live):
        batch["live_routes"] = live_batch["recorded_routes"]
    result["live_vs_recorded"] = agreement(micro, "live_routes", "recorded_routes", engine.routes.layers)
    result["live_vs_engine"] = agreement(micro, "live_routes", "engine_routes", engine.routes.layers)

    # R2 replay, then R3 replay: consecutive steps with different routes
    for name, key in (("r2", "recorded_routes"), ("r3", "engine_routes")):
        step = engine.train_step(micro, sft_loss, replay_key=key, record_routes=True)
        result[name] = {
            **match_calls(spy.take(), [b[key] for b in micro]),
            "loss": step.loss,
            "leak": replay_state_left(engine),
            "agreement_used": engine.routing_agreement(micro, "used_routes", key),
            "agreement_engine_live": engine.routing_agreement(micro, "engine_routes", "live_routes"),
        }

    # no replay: live routing again, nothing left behind
    engine.train_step(micro, sft_loss, record_routes=True)
    live_calls = spy.take()
    result["live_step"] = {
        **match_calls(live_calls, [b["used_routes"] for b in micro]),
        "leak": replay_state_left(engine),
    }
    result["route_seconds"] = engine.take_route_seconds()
    spy.remove()
    return result
