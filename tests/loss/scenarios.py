"""Per-rank bodies of the multi-process loss tests (imported by spawned workers).

One spawn runs several cases one after the other (the parallel state is rebuilt between layouts), because
starting processes costs far more than a tiny-model step. ``megatron.core`` is imported inside functions:
``sapo_megatron.megatron`` must be imported first (it registers import stubs).
"""

from __future__ import annotations

from typing import Any

import torch

from sapo_megatron.megatron.logprobs import vocab_parallel_logprobs
from sapo_megatron.megatron.loss_hook import LogprobOutput, PolicyLossHook, add_global_normalisers
from sapo_megatron.megatron.parallel import init_parallel, rank_info
from sapo_megatron.megatron.train_step import MicroBatch, TrainEngine
from sapo_megatron.megatron.weights import iter_hf_weights
from tests.megatron.scenarios import layout_config

RL_KEYS = ("loss_mask", "advantages", "old_logp", "rollout_logp", "ref_logp")


def run_cases(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``payload["cases"]`` in order on this rank; each case is merged over the shared payload."""
    results = []
    for case in payload["cases"]:
        merged = {**payload, **case}
        setup_layout(merged)
        kind = merged.get("kind", "rl_step")
        results.append({"rl_step": rl_step, "tp_logprobs": tp_logprobs}[kind](merged))
    return results


def setup_layout(payload: dict[str, Any]) -> None:
    from megatron.core import parallel_state

    cfg = layout_config(payload)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    init_parallel(cfg.parallel, seed=0, cfg=cfg)


def rl_micro_batches(data: dict[str, torch.Tensor], micro_batches: int) -> list[MicroBatch]:
    """This data-parallel rank's rows of the global batch as micro-batches, global normalisers included."""
    info = rank_info()
    rows = data["ids"].shape[0] // info.dp_size
    mine = {k: v[info.dp_rank * rows : (info.dp_rank + 1) * rows] for k, v in data.items()}
    batches = [
        {
            "input_ids": chunk["ids"][:, :-1].contiguous(),
            "labels": chunk["ids"][:, 1:].contiguous(),
            **{k: chunk[k].contiguous() for k in RL_KEYS if k in chunk},
        }
        for chunk in _split_rows(mine, micro_batches)
    ]
    return add_global_normalisers(batches)


def _split_rows(data: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    pieces = {k: v.chunk(parts) for k, v in data.items()}
    return [{k: pieces[k][i] for k in data} for i in range(parts)]


def rl_step(payload: dict[str, Any]) -> dict[str, Any]:
    """forward_only log-probs, then one SGD(lr 1) step with the policy loss hook; ``old_logp="current"`` uses
    the forward_only log-probs as old_logp (ratio 1)."""
    cfg = layout_config(payload)
    engine = TrainEngine(cfg, total_steps=1)
    batches = rl_micro_batches(payload["data"], cfg.parallel.micro_batches)
    current = engine.forward_only(batches, LogprobOutput(with_entropy=True))
    if payload.get("old_logp") == "current":
        old = _broadcast_from_last_stage([c[0] for c in current] if current is not None else None)
        batches = [{**b, "old_logp": o} for b, o in zip(batches, old)]
    hook = PolicyLossHook(payload["loss"], payload.get("correction"))
    result = engine.train_step(batches, hook)
    weights = {
        n: t.float().clone() for n, t in iter_hf_weights(engine.module, cfg.model.arch, owned_only=True)
    }
    info = rank_info()
    return {
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "metrics": result.metrics,
        "weights": weights,
        "dp_rank": info.dp_rank,
        "tp_rank": info.tp_rank,
        "current": None if current is None else torch.cat(list(current), dim=1),  # [2, rows, s]
    }


def _broadcast_from_last_stage(tensors: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """Pipeline: forward_only results exist on the last stage only; every stage needs the old_logp."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return tensors
    box = [tensors]
    torch.distributed.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]


def tp_logprobs(payload: dict[str, Any]) -> dict[str, Any]:
    """Log-probs, entropy and logits gradients of this rank's vocab shard of ``payload["logits"]``."""
    from megatron.core import parallel_state

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    out = {}
    for name, spec in payload["variants"].items():
        full = payload["logits"].to(spec["dtype"])
        shard = full.chunk(tp_size, dim=-1)[tp_rank].clone().requires_grad_()
        logp, entropy = vocab_parallel_logprobs(
            shard, payload["labels"], temperature=spec["temperature"], chunk_tokens=spec["chunk_tokens"]
        )
        (logp * payload["g_logp"] + entropy * payload["g_ent"]).sum().backward()
        out[name] = {"logp": logp.detach(), "entropy": entropy.detach(), "grad": shard.grad}
    return {"tp_rank": tp_rank, "variants": out}
