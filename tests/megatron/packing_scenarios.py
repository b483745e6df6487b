"""Per-rank bodies of the packing tests (imported by spawned workers): the same RL update in one process group,
once with right-padded micro-batches and once packed, every result keyed by sequence so the two can be compared.

Both runs start from the same weights (the gradients compared are DDP's reduced ``main_grad``). Per run: the old-log-prob
pass (forward-only, live routing, routes recorded), then old / reference / rollout log-probs made from it with
per-token noise carried by ``TrainSequence.token_values`` (the generic per-token keys), a SAPO update replaying
the engine's routes (R3, entropy and KL terms, TIS) and a GSPO update with live routing (sequence-level ratios).
"""

from __future__ import annotations

# megatron-core 0.19 imports triton at import time unless sapo_megatron's stand-ins are registered first
import sapo_megatron.megatron  # noqa: F401  # isort: skip

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sapo_megatron.megatron.context_parallel import batch_shards, gather_tokens, shard_tokens
from sapo_megatron.megatron.loss_hook import LogprobOutput, PolicyLossHook
from sapo_megatron.megatron.parallel import data_parallel_group, rank_info
from sapo_megatron.megatron.routing_replay import ENGINE_ROUTES, RECORDED_ROUTES, USED_ROUTES
from sapo_megatron.megatron.sft import sft_loss
from sapo_megatron.megatron.train_step import TrainEngine
from sapo_megatron.model.batching import SEQUENCE_INDEX, RouteLayout, TrainSequence
from sapo_megatron.model.packing import SequenceView
from tests.loss.scenarios import setup_layout
from tests.megatron.replay_scenarios import RouteSpy, match_calls, rank_micro_batches
from tests.megatron.scenarios import layout_config

NOISE_KEYS = {"old_logp": "logp_noise", "ref_logp": "ref_noise", "rollout_logp": "rollout_noise"}
LOSSES = {
    "sapo_r3": (
        {"name": "sapo", "entropy_coef": 0.01, "kl_coef": 0.01},
        {"name": "tis", "cap": 2.0},
        ENGINE_ROUTES,
    ),
    "gspo_live": ({"name": "gspo", "eps_low": 0.02, "eps_high": 0.03}, None, None),
    "grpo_token_mean": ({"name": "grpo", "agg": "token-mean"}, None, None),
}


def rl_sequences(layout: RouteLayout, count: int, seed: int) -> list[TrainSequence]:
    """Prompts of 3-8 and responses of 2-19 tokens, advantages of both signs (one 0), random valid routes, and
    per-response-token noise for the old / reference / rollout log-probs."""
    gen = np.random.default_rng(seed)
    out = []
    for i in range(count):
        prompt = gen.integers(1, 60, size=int(gen.integers(3, 9))).tolist()
        response = gen.integers(1, 60, size=int(gen.integers(2, 20))).tolist()
        rows = len(prompt) + len(response) - 1
        routes = np.argsort(gen.random((rows, layout.num_layers, layout.num_experts)), axis=-1)[
            ..., : layout.top_k
        ]
        scales = {"logp_noise": 0.3, "ref_noise": 0.2, "rollout_noise": 0.1}
        noise = {key: (scale * gen.standard_normal(len(response))).tolist() for key, scale in scales.items()}
        out.append(
            TrainSequence(
                prompt,
                response,
                advantage=0.0 if i == 3 else float(gen.uniform(-1.5, 1.5)),
                routed_experts=routes.astype(np.int32),
                sample_id=f"s{i}",
                token_values=noise,
            )
        )
    return out


def packing_cases(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of ``payload["cases"]`` (a layout and the updates to run) in turn, the parallel state rebuilt between
    them: one spawn serves several layouts."""
    return [packing_layout({**payload, **case}) for case in payload["cases"]]


def packing_layout(payload: dict[str, Any]) -> dict[str, Any]:
    """The padded and the packed run of one layout; ``payload["updates"]`` names the entries of ``LOSSES`` to run,
    ``payload["sft"]`` adds an SFT step."""
    setup_layout(payload)
    cfg = layout_config(payload)
    engine = TrainEngine(cfg, routing_replay=True, total_steps=8)
    initial = {k: v.clone() for k, v in engine.module.state_dict().items() if isinstance(v, torch.Tensor)}
    layout = RouteLayout.from_arch(cfg.model.arch)
    sequences = rl_sequences(layout, payload["sequences"], seed=7)
    out: dict[str, Any] = {"rank": rank_info().__dict__}
    for name, budget in (("padded", None), ("packed", payload["budget"])):
        engine.module.load_state_dict(initial, strict=False)
        micro = rank_micro_batches(cfg, sequences, layout, budget)
        out[name] = {
            "shapes": _all_shapes(micro),
            "sequences_per_micro_batch": [len(b[SEQUENCE_INDEX]) for b in micro],
            **_old_logp_pass(engine, micro),
            "updates": _updates(engine, micro, initial, payload["updates"]),
        }
        if payload.get("sft"):
            out[name]["updates"]["sft"] = _sft(engine, micro, initial)
    return out


def _all_shapes(micro: list[dict]) -> list[list[tuple[int, ...]]]:
    """Every rank's micro-batch shapes (``input_ids``), gathered: the schedule needs one count and shape."""
    mine = [tuple(b["input_ids"].shape) for b in micro]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _per_sequence(micro: list[dict], values: list[torch.Tensor], mask_key: str = "loss_mask") -> dict:
    """``{sequence index: values at its mask_key positions}`` from per-micro-batch ``[b, s, ...]`` tensors."""
    out = {}
    for batch, value in zip(micro, values):
        view = SequenceView(batch)
        rows, mask = view(value), view(batch[mask_key]).bool()
        for row, index in enumerate(batch[SEQUENCE_INDEX].tolist()):
            out[index] = rows[row][mask[row]].clone()
    return out


def _old_logp_pass(engine: TrainEngine, micro: list[dict]) -> dict[str, Any]:
    queries: list[
        torch.Tensor
    ] = []  # what this stage's first attention sees: queries after RoPE [s, b, h, d]
    attention = engine.module.decoder.layers[0].self_attention.core_attention
    handle = attention.register_forward_pre_hook(
        lambda module, args: queries.append(args[0].detach().clone())
    )
    try:
        current = engine.forward_only(micro, LogprobOutput(with_entropy=True), record_routes=True)
    finally:
        handle.remove()
    result: dict[str, Any] = {
        "routes": _per_sequence(micro, [b[RECORDED_ROUTES] for b in micro]),
        # context parallelism: this rank's chunks, gathered back into whole sequences
        "queries": _per_sequence(
            micro, [gather_tokens(q.transpose(0, 1), batch_shards(b)) for q, b in zip(queries, micro)]
        ),
    }
    result["agreement"] = engine.routing_agreement(micro, ENGINE_ROUTES, RECORDED_ROUTES)
    if current is None:  # not the last pipeline stage: the loss runs elsewhere
        return result
    for batch, both in zip(micro, current):
        logp = both[0]
        for key, noise in NOISE_KEYS.items():
            batch[key] = logp + batch[noise]
    result["logp"] = _per_sequence(micro, [c[0] for c in current])
    result["entropy"] = _per_sequence(micro, [c[1] for c in current])
    return result


def _updates(engine: TrainEngine, micro: list[dict], initial: dict, names: list[str]) -> dict[str, Any]:
    out = {}
    spy = RouteSpy(engine.module, micro[0]["input_ids"].shape[0])
    for name in names:
        loss, correction, replay_key = LOSSES[name]
        engine.module.load_state_dict(initial, strict=False)
        spy.take()
        step = engine.train_step(
            micro, PolicyLossHook(loss, correction), replay_key=replay_key, record_routes=True
        )
        calls = spy.take()
        out[name] = {
            "loss": step.loss,
            "grad_norm": step.grad_norm,
            "metrics": step.metrics,
            "grads": _grads(engine),
            "used": engine.routing_agreement(micro, USED_ROUTES, ENGINE_ROUTES)[0],
            "router_calls": match_calls(calls, _router_sources(micro)) if replay_key else None,
        }
    spy.remove()
    return out


def _router_sources(micro: list[dict]) -> list[torch.Tensor]:
    """The engine's routes of each micro-batch as this rank's routers see its tokens (context parallelism: this
    rank's chunks of each sequence)."""
    return [shard_tokens(b[ENGINE_ROUTES], batch_shards(b)) for b in micro]


def _sft(engine: TrainEngine, micro: list[dict], initial: dict) -> dict[str, float]:
    engine.module.load_state_dict(initial, strict=False)
    total = sum(b["loss_mask"].sum() for b in micro).double().reshape(1)
    dist.all_reduce(total, group=data_parallel_group())
    step = engine.train_step([{**b, "num_tokens_global": total.float()[0]} for b in micro], sft_loss)
    return {"loss": step.loss, "grad_norm": step.grad_norm, "grads": _grads(engine)}


def _grads(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """This rank's reduced gradients (DDP's ``main_grad``) of the step just taken, per parameter."""
    return {n: p.main_grad.detach().clone() for n, p in engine.module.named_parameters()}
