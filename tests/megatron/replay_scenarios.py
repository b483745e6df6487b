"""Per-rank bodies of the routing-replay tests (imported by spawned workers).

The routing a router *used* is observed independently of ``RouterReplay``: a forward hook on every ``TopKRouter``
reads the ``routing_map`` it returned (the experts the dispatcher sends each token to) – in the forward and again
in any recomputation during the backward.
"""

from __future__ import annotations

# megatron-core 0.19 imports triton at import time unless sapo_megatron's stand-ins are registered first
import sapo_megatron.megatron  # noqa: F401  # isort: skip

import copy
import pickle
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay

from sapo_megatron.config import sequence_length_multiple
from sapo_megatron.megatron.loss_hook import LogprobOutput, add_global_normalisers
from sapo_megatron.megatron.parallel import data_parallel_group, init_parallel, rank_info
from sapo_megatron.megatron.routing import agreement_counts, agreement_from_counts
from sapo_megatron.megatron.routing_replay import check_supported
from sapo_megatron.megatron.sft import sft_loss
from sapo_megatron.megatron.train_step import MicroBatch, TrainEngine
from sapo_megatron.model.batching import RouteLayout, RoutingReplayError, TrainSequence, build_micro_batches
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


def rank_micro_batches(
    cfg, sequences: list[TrainSequence], layout: RouteLayout, budget: int | None = None
) -> list[MicroBatch]:
    """This rank's micro-batches of ``sequences`` in the configured layout (padded, or packed to ``budget``
    tokens), with the engine's routes and the global normalisers."""
    info, par = rank_info(), cfg.parallel
    micro = build_micro_batches(
        sequences,
        dp_rank=info.dp_rank,
        dp_size=info.dp_size,
        micro_batches=par.micro_batches,
        pad_id=0,
        length_multiple=sequence_length_multiple(cfg),
        route_layout=layout,
        max_tokens_per_micro_batch=budget,
    )
    return add_global_normalisers(micro)


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
    engine = TrainEngine(cfg, routing_replay=True, total_steps=4)
    recompute_layers = enable_moe_recompute(engine.module) if payload.get("recompute") else 0
    layout = RouteLayout.from_arch(cfg.model.arch)
    micro = rank_micro_batches(cfg, tiny_sequences(layout, payload["sequences"], seed=5), layout)
    spy = RouteSpy(engine.module, micro[0]["input_ids"].shape[0])
    result: dict[str, Any] = {"layers": engine.routes.layers, "recompute_layers": recompute_layers}
    fp8_micro = _fp8_engine_micro_batches(payload, cfg, layout)
    if fp8_micro is not None:  # the trainer's live routing at the engine's weights: below 1 under fp8
        engine.forward_only(fp8_micro, LogprobOutput(), record_routes=True)
        spy.take()
        result["fp8_live_vs_engine"] = engine.routing_agreement(fp8_micro, "recorded_routes", "engine_routes")

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

    # R3's old-log-prob pass: forward-only with the engine's routes (its log-probs differ from live routing's)
    replayed_logp = engine.forward_only(micro, LogprobOutput(), replay_key="engine_routes")
    replayed_calls = spy.take()
    live_logp = engine.forward_only(micro, LogprobOutput())
    spy.take()
    result["r3_forward_only"] = {
        **match_calls(replayed_calls, [b["engine_routes"] for b in micro]),
        "leak": replay_state_left(engine),
        "logp_change": None
        if replayed_logp is None
        else max(float((a - b).abs().max()) for a, b in zip(replayed_logp, live_logp)),
    }

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
    if fp8_micro is not None:  # R3 with the fp8 engine's real routes: used everywhere, forward and recompute
        engine.train_step(fp8_micro, sft_loss, replay_key="engine_routes", record_routes=True)
        result["fp8_r3"] = {
            **match_calls(spy.take(), [b["engine_routes"] for b in fp8_micro]),
            "leak": replay_state_left(engine),
            "agreement_used": engine.routing_agreement(fp8_micro, "used_routes", "engine_routes"),
        }
    result["route_seconds"] = engine.take_route_seconds()
    spy.remove()
    return result


def _fp8_engine_micro_batches(payload: dict[str, Any], cfg, layout: RouteLayout) -> list[MicroBatch] | None:
    """This rank's micro-batches of the sequences an fp8 CPU engine generated (``payload["fp8_sequences"]``, a
    pickled list of :class:`TrainSequence` with the engine's routes), or None."""
    if not payload.get("fp8_sequences"):
        return None
    with open(payload["fp8_sequences"], "rb") as handle:
        sequences = pickle.load(handle)
    return rank_micro_batches(cfg, sequences, layout)


class RouterTap:
    """A router's input ``x`` [s, b, H], output probabilities [s*b, E] and their gradient from the backward."""

    def __init__(self, router: TopKRouter) -> None:
        self.inputs: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.handle = router.register_forward_hook(self._hook)

    def _hook(self, _module, inputs, output) -> None:
        probs = output[0]
        self.inputs.append(inputs[0].detach().clone())
        self.probs.append(probs.detach().clone())
        if probs.requires_grad:
            probs.register_hook(lambda grad: self.grads.append(grad.detach().clone()))


def replayed_router_grad(
    x: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor, grad_probs: torch.Tensor, pre_softmax: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """By hand: the gate probabilities [T, E] and dL/dW [E, H] of a softmax router whose top-k is replaced by
    ``experts`` [T, k], given dL/dprobs [T, E]. After-top-k softmax: p = softmax(z[S]); pre-softmax: p = softmax(z)[S].
    The softmax Jacobian gives dz = p ⊙ (G − ⟨p, G⟩) over the experts the softmax ran on."""
    x = x.reshape(-1, x.shape[-1]).double()
    logits = x @ weight.double().T  # [T, E]
    grad_probs = grad_probs.double()
    probs = torch.zeros_like(logits)
    dlogits = torch.zeros_like(logits)
    if pre_softmax:
        scores = torch.softmax(logits, dim=-1)  # over all experts
        probs.scatter_(1, experts, scores.gather(1, experts))
        upstream = torch.zeros_like(logits).scatter(1, experts, grad_probs.gather(1, experts))
        dlogits = scores * (upstream - (scores * upstream).sum(-1, keepdim=True))
    else:
        gate = torch.softmax(logits.gather(1, experts), dim=-1)  # over the replayed experts only
        probs.scatter_(1, experts, gate)
        upstream = grad_probs.gather(1, experts)
        dlogits.scatter_(1, experts, gate * (upstream - (gate * upstream).sum(-1, keepdim=True)))
    return probs, dlogits.T @ x


def router_gradient(payload: dict[str, Any]) -> dict[str, Any]:
    """One training step replaying random engine routes; the router's gradient vs the formula, per layer."""
    cfg = layout_config(payload)
    init_parallel(cfg.parallel, seed=0, cfg=cfg)
    engine = TrainEngine(cfg, routing_replay=True, total_steps=1)
    layout = RouteLayout.from_arch(cfg.model.arch)
    micro = add_normaliser(
        build_micro_batches(
            tiny_sequences(layout, 4, seed=9),
            dp_rank=0,
            dp_size=1,
            micro_batches=1,
            pad_id=0,
            route_layout=layout,
        )
    )
    routers = {
        layer.layer_number - 1: layer.mlp.router
        for layer in engine.module.decoder.layers
        if isinstance(getattr(layer.mlp, "router", None), TopKRouter)
    }
    taps = {layer: RouterTap(router) for layer, router in routers.items()}
    weights = {layer: router.weight.detach().clone() for layer, router in routers.items()}
    engine.train_step(micro, sft_loss, replay_key="engine_routes")
    pre_softmax = not cfg.model.arch.norm_topk_prob
    out = {}
    for layer, tap in taps.items():
        (x,), (probs,), (grad,) = tap.inputs, tap.probs, tap.grads
        routes = micro[0]["engine_routes"][:, :, layer].long()  # [b, s, k] -> tokens sequence-major
        experts = routes.transpose(0, 1).reshape(-1, layout.top_k)
        want_probs, want_grad = replayed_router_grad(x, weights[layer], experts, grad, pre_softmax)
        live = x.reshape(-1, x.shape[-1]).double() @ weights[layer].double().T
        live_experts = live.topk(layout.top_k, dim=-1).indices
        _, live_grad = replayed_router_grad(x, weights[layer], live_experts, grad, pre_softmax)
        got = routers[layer].weight.main_grad.double()
        out[layer] = {
            "probs_err": float((probs.double() - want_probs).abs().max()),
            "grad_err": float((got - want_grad).abs().max()),
            "grad_scale": float(want_grad.abs().max()),
            "live_formula_err": float((got - live_grad).abs().max()),
            "live_overlap": float(
                (live_experts.sort(-1).values == experts.sort(-1).values).all(-1).double().mean()
            ),
        }
    return out


def _error(fn) -> str:
    """The message of the ``RoutingReplayError`` that ``fn()`` raises ("" if it raises none)."""
    try:
        fn()
    except RoutingReplayError as err:
        return str(err)
    return ""


def refusals(payload: dict[str, Any]) -> dict[str, Any]:
    """What routing replay refuses, before anything trains, and that a failed step leaves no replay state."""
    cfg = layout_config(payload)
    init_parallel(cfg.parallel, seed=0, cfg=cfg)
    layout = RouteLayout.from_arch(cfg.model.arch)
    micro = add_normaliser(
        build_micro_batches(
            tiny_sequences(layout, 2, seed=1),
            dp_rank=0,
            dp_size=1,
            micro_batches=1,
            pad_id=0,
            route_layout=layout,
        )
    )
    plain = TrainEngine(cfg)
    out = {
        "dense": _error(
            lambda: TrainEngine(
                layout_config({**payload, "hf_dir": payload["dense_dir"]}), routing_replay=True
            )
        ),
        "record_without_replay": _error(
            lambda: plain.forward_only(micro, LogprobOutput(), record_routes=True)
        ),
        "replay_without_replay": _error(
            lambda: plain.train_step(micro, sft_loss, replay_key="engine_routes")
        ),
    }
    engine = TrainEngine(cfg, routing_replay=True)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    short = [{**micro[0], "engine_routes": micro[0]["engine_routes"][:, :-1]}]
    holes = [{**micro[0], "engine_routes": micro[0]["engine_routes"].clone()}]
    holes[0]["engine_routes"][0, 3, 1] = -1
    out["missing_key"] = _error(lambda: engine.train_step(micro, sft_loss, replay_key="recorded_routes"))
    out["wrong_shape"] = _error(lambda: engine.train_step(short, sft_loss, replay_key="engine_routes"))
    out["hole"] = _error(lambda: engine.train_step(holes, sft_loss, replay_key="engine_routes"))
    out["agreement_missing_key"] = _error(
        lambda: engine.routing_agreement(micro, "used_routes", "engine_routes")
    )
    out["record_and_replay"] = _error(
        lambda: engine.forward_only(micro, LogprobOutput(), record_routes=True, replay_key="engine_routes")
    )
    out["weights_unchanged"] = all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())

    def failing_loss(logits, batch):
        raise RuntimeError("loss failed")

    try:
        engine.train_step(micro, failing_loss, replay_key="engine_routes")
    except RuntimeError as err:
        out["failed_step"] = str(err)
    out["leak_after_failure"] = replay_state_left(engine)
    for field, value in (
        ("moe_router_fusion", True),
        ("virtual_pipeline_model_parallel_size", 2),
        ("mtp_num_layers", 1),
    ):
        config = copy.copy(engine.config)
        setattr(config, field, value)
        out[field] = _error(lambda config=config: check_supported(config))
    return out


def engine_routes_end_to_end(payload: dict[str, Any]) -> dict[str, Any]:
    """Routes from the CPU rollout engine (HF transformers, same weights) through ``build_micro_batches`` onto the
    trainer's positions: they agree with the trainer's own live routing (and not when shifted by one position);
    after perturbing the trainer's routers, R3 replay still uses them exactly."""
    from sapo_megatron.megatron.routing import routing_agreement_by_layer
    from sapo_megatron.rollout.cpu.engine import CPUEngine
    from sapo_megatron.rollout.types import GenerationRequest, SamplingParams

    cfg = layout_config(payload)
    init_parallel(cfg.parallel, seed=0, cfg=cfg, cpu_threads=1)
    rollout = CPUEngine.from_pretrained(payload["hf_dir"], seed=3, num_threads=1)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=11)
    prompts = [[3, 17, 5, 9], [40, 2, 8], [21, 22, 23, 24, 25], [7, 1]]
    groups = rollout.generate(
        [
            GenerationRequest(prompt_ids=p, n=2, sampling=sampling, return_routed_experts=True, group_id=i)
            for i, p in enumerate(prompts)
        ]
    )
    sequences = [
        TrainSequence(
            s.prompt_ids, s.response_ids, 1.0, s.rollout_logp, s.routed_experts, f"group {g} sample {i}"
        )
        for g, group in enumerate(groups)
        for i, s in enumerate(group)
    ]
    layout = RouteLayout.from_arch(cfg.model.arch)
    micro = add_normaliser(
        build_micro_batches(sequences, dp_rank=0, dp_size=1, micro_batches=2, pad_id=0, route_layout=layout)
    )
    engine = TrainEngine(cfg, routing_replay=True, total_steps=1)
    engine.forward_only(micro, LogprobOutput(), record_routes=True)
    aligned, _ = engine.routing_agreement(micro, "engine_routes", "recorded_routes")
    shifted = [
        routing_agreement_by_layer(
            b["engine_routes"][:, 1:], b["recorded_routes"][:, :-1], b["loss_mask"][:, 1:]
        )[0]
        for b in micro
    ]
    perturb_routers(engine.module, payload["perturb"])
    engine.forward_only(micro, LogprobOutput(), record_routes=True)
    perturbed, _ = engine.routing_agreement(micro, "engine_routes", "recorded_routes")
    spy = RouteSpy(engine.module, micro[0]["input_ids"].shape[0])
    engine.train_step(micro, sft_loss, replay_key="engine_routes", record_routes=True)
    return {
        "aligned": aligned,
        "shifted_by_one": max(shifted),
        "perturbed_live": perturbed,
        "replayed": match_calls(spy.take(), [b["engine_routes"] for b in micro]),
        "used": engine.routing_agreement(micro, "used_routes", "engine_routes"),
        "tokens": int(sum(b["loss_mask"].sum() for b in micro)),
    }
