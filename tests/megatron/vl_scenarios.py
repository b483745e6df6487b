"""Per-rank bodies of the Qwen3-VL-MoE layout tests (imported by spawned workers): logits through the pipeline
schedule and one SFT step on text + image rows."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sapo_megatron.megatron.forward import forward_logits
from sapo_megatron.megatron.model import BuildOptions, build_gpt_model
from sapo_megatron.megatron.parallel import data_parallel_group, init_parallel, is_reporting_rank, rank_info
from sapo_megatron.megatron.sft import sft_loss
from sapo_megatron.megatron.train_step import MicroBatch, TrainEngine, init_weights
from sapo_megatron.megatron.weights import iter_hf_weights
from tests.megatron.scenarios import layout_config


def select_rows(
    batch: dict[str, torch.Tensor], rows: list[int], vision_start_id: int
) -> dict[str, torch.Tensor]:
    """``rows`` of a :func:`~sapo_megatron.model.tiny.vl_batch` with their images' patches and grids (images are
    in reading order; a row holds one image per ``<vision_start>``)."""
    per_row = (batch["input_ids"] == vision_start_id).sum(1).tolist()
    first = [sum(per_row[:r]) for r in range(len(per_row))]
    images = [i for r in rows for i in range(first[r], first[r] + per_row[r])]
    out = {k: batch[k][rows] for k in ("input_ids", "attention_mask")}
    if images:
        grid = batch["image_grid_thw"]
        start = torch.cat([torch.zeros(1, dtype=torch.long), grid.prod(-1).cumsum(0)])
        out["pixel_values"] = torch.cat([batch["pixel_values"][start[i] : start[i + 1]] for i in images])
        out["image_grid_thw"] = grid[images]
    return out


def vl_micro_batches(
    batch: dict[str, torch.Tensor], micro_batches: int, vision_start_id: int
) -> list[MicroBatch]:
    """This data-parallel rank's rows, as SFT micro-batches with their images."""
    info = rank_info()
    rows = batch["input_ids"].shape[0] // info.dp_size
    mine = list(range(info.dp_rank * rows, (info.dp_rank + 1) * rows))
    total = batch["attention_mask"][mine][:, 1:].sum().double()
    dist.all_reduce(total, group=data_parallel_group())
    out = []
    for chunk in torch.tensor(mine).chunk(micro_batches):
        part = select_rows(batch, chunk.tolist(), vision_start_id)
        ids, mask = part.pop("input_ids"), part.pop("attention_mask")
        out.append(
            {
                "input_ids": ids[:, :-1].contiguous(),
                "labels": ids[:, 1:].contiguous(),
                "loss_mask": mask[:, 1:].contiguous(),
                "num_tokens_global": total.float(),
                **part,
            }
        )
    return out


def vl_step(payload: dict[str, Any]) -> dict[str, Any]:
    """Logits of the whole batch (last stage, first TP / DP rank), then one SFT step: loss, grad norm and the
    updated weights this rank publishes."""
    cfg = layout_config(payload)
    arch = cfg.model.arch
    init_parallel(cfg.parallel, seed=0, cfg=cfg)
    batch = payload["batch"]
    module = build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision))
    init_weights(module, cfg)
    images = {k: batch[k] for k in ("pixel_values", "image_grid_thw")}
    logits = forward_logits(module, batch["input_ids"][:, :-1].contiguous(), **images)
    engine = TrainEngine(cfg, total_steps=1)
    result = engine.train_step(
        vl_micro_batches(batch, cfg.parallel.micro_batches, arch.vision_start_token_id), sft_loss
    )
    weights = {n: t.float().clone() for n, t in iter_hf_weights(engine.module, arch, owned_only=True)}
    return {
        "logits": logits if logits is not None and is_reporting_rank() else None,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "weights": weights,
    }
