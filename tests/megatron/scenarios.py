"""Per-rank bodies of the multi-process tests (imported by spawned workers)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sapo_megatron.config import RunConfig, config_from_dict
from sapo_megatron.megatron.parallel import data_parallel_group, init_parallel, rank_info
from sapo_megatron.megatron.sft import sft_loss
from sapo_megatron.megatron.train_step import MicroBatch, TrainEngine
from sapo_megatron.megatron.weights import iter_hf_weights


def layout_config(payload: dict[str, Any]) -> RunConfig:
    hf_dir = payload["hf_dir"]
    raw = {
        "model": {"hf_config": hf_dir, "init": "hf", "init_path": hf_dir, **payload.get("model", {})},
        "parallel": payload["parallel"],
        "launch": {"procs_per_node": payload["world"]},
        "optimizer": {
            "name": "sgd",
            "lr": 1.0,
            "weight_decay": 0.0,
            "clip_grad": 0.0,
            **payload.get("optimizer", {}),
        },
        "precision": payload.get("precision", {}),
    }
    return config_from_dict(raw)


def sft_micro_batches(ids: torch.Tensor, mask: torch.Tensor, micro_batches: int) -> list[MicroBatch]:
    """This data-parallel rank's rows of the global batch, split into micro-batches of SFT tensors."""
    info = rank_info()
    dp, rank = info.dp_size, info.dp_rank
    rows = ids.shape[0] // dp
    ids, mask = ids[rank * rows : (rank + 1) * rows], mask[rank * rows : (rank + 1) * rows]
    total = mask[:, 1:].sum().double()
    dist.all_reduce(total, group=data_parallel_group())
    return [
        {
            "input_ids": ids_mb[:, :-1].contiguous(),
            "labels": ids_mb[:, 1:].contiguous(),
            "loss_mask": mask_mb[:, 1:].contiguous(),
            "num_tokens_global": total.float(),
        }
        for ids_mb, mask_mb in zip(ids.chunk(micro_batches), mask.chunk(micro_batches))
    ]


def sft_step(payload: dict[str, Any]) -> dict[str, Any]:
    """One SFT optimizer step under a layout; returns loss, grad norm and the updated weights this rank owns."""
    cfg = layout_config(payload)
    init_parallel(cfg.parallel, seed=0, cfg=cfg)
    engine = TrainEngine(cfg, total_steps=1)
    batches = sft_micro_batches(payload["ids"], payload["mask"], cfg.parallel.micro_batches)
    result = engine.train_step(batches, sft_loss)
    weights = {
        n: t.float().clone() for n, t in iter_hf_weights(engine.module, cfg.model.arch, owned_only=True)
    }
    return {
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "nll": result.metrics["sft/nll"],
        "weights": weights,
    }


def nonfinite_then_finite(payload: dict[str, Any]) -> dict[str, Any]:
    """Step 1: the loss is NaN on rank ``nan_rank`` only; step 2: finite everywhere. Returns the weights this rank
    owns before, after step 1 and after step 2, each step's result and the LR scheduler's step count."""
    cfg = layout_config({**payload, "optimizer": {"name": "adam", "lr": 1e-2, "clip_grad": 1.0}})
    init_parallel(cfg.parallel, seed=0, cfg=cfg)
    engine = TrainEngine(cfg, total_steps=2)
    batches = sft_micro_batches(payload["ids"], payload["mask"], cfg.parallel.micro_batches)

    def weights() -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in iter_hf_weights(engine.module, cfg.model.arch, owned_only=True)}

    def poisoned(logits, batch):
        loss, metrics = sft_loss(logits, batch)
        return (loss * float("nan") if dist.get_rank() == payload["nan_rank"] else loss), metrics

    before = weights()
    first = engine.train_step(batches, poisoned)
    after_first, scheduler_steps = weights(), engine.scheduler.num_steps
    second = engine.train_step(batches, sft_loss)
    return {
        "before": before,
        "after_first": after_first,
        "after_second": weights(),
        "first": (first.update_successful, first.grad_norm),
        "second": (second.update_successful, second.grad_norm),
        "scheduler_steps": (scheduler_steps, engine.scheduler.num_steps),
    }


def process_group_timeouts(payload: dict[str, Any]) -> list[float]:
    """The timeouts (s) of the default group and Megatron's data-parallel group after ``init_parallel``."""
    cfg = layout_config(payload)
    init_parallel(cfg.parallel, seed=0, cfg=cfg, timeout_minutes=payload["timeout_minutes"])
    groups = (dist.distributed_c10d._get_default_group(), data_parallel_group())
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]


def offload_steps(payload: dict[str, Any]) -> dict[str, Any]:
    """Three SFT steps; with ``payload["offload"]`` the trainer is offloaded after each step as a colocated step
    does it (everything; then the parameters alone come back for the weight export and leave again), and onloaded
    before the next. Returns per-step loss and grad norm, the final weights, and the bytes left on the device
    while offloaded."""
    from sapo_megatron.megatron.offload import TrainerOffload

    cfg = layout_config(payload)
    init_parallel(cfg.parallel, seed=0, cfg=cfg)
    engine = TrainEngine(cfg, total_steps=3)
    offload = TrainerOffload(engine.model, engine.optimizer) if payload["offload"] else None
    steps, resident, exported = [], [], []
    for step in range(3):
        batches = sft_micro_batches(payload["ids"][step], payload["mask"][step], cfg.parallel.micro_batches)
        result = engine.train_step(batches, sft_loss)
        steps.append((result.loss, result.grad_norm, result.metrics["sft/nll"]))
        if offload is not None:
            offload.offload()
            resident.append(sum(p.untyped_storage().nbytes() for p in engine.module.parameters()))
            offload.onload(["params"])  # the weight source of the sync
            exported.append(_owned_weights(engine, cfg))
            offload.offload(["params"])
            offload.onload()
        else:
            exported.append(_owned_weights(engine, cfg))
    optimizer_state = [
        v.float().clone()
        for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
        for state in opt.optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return {
        "steps": steps,
        "exported": exported,
        "resident": resident,
        "optimizer_state": optimizer_state,
        "moved": offload.nbytes() if offload is not None else 0,
    }


def _owned_weights(engine: TrainEngine, cfg: RunConfig) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in iter_hf_weights(engine.module, cfg.model.arch, owned_only=True)}
