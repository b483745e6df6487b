"""Per-rank bodies of the distillation-step tests (spawned over gloo by tests/distributed.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sapo_megatron.config import config_from_dict
from sapo_megatron.distill.step import DistillStep
from sapo_megatron.tiny import tiny_hf_config

SAF = {"mode": "saf", "warmup": {"steps": 4}, "anneal": {"steps": 4}}
DOMAINS = ["addition", "multiplication"]


def distill_config(fusion: dict[str, Any], **algorithm: Any):
    return config_from_dict(
        {
            "model": {"hf_config": tiny_hf_config("dense")},
            "teachers": [{"name": "t", "model_path": "unused", "default": True}],
            "algorithm": {"fusion": fusion, **algorithm},
        }
    )


def make_batches(seed: int = 0, count: int = 4, rows: int = 3, length: int = 7) -> list[dict]:
    """Micro-batches as the trainer holds them after the old-log-prob pass (last pipeline stage)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        mask = torch.zeros(rows, length)
        for r in range(rows):
            start = int(torch.randint(1, 3, (1,), generator=gen))
            stop = int(torch.randint(start + 1, length + 1, (1,), generator=gen))
            mask[r, start:stop] = 1.0
        batches.append(
            {
                "loss_mask": mask,
                "old_logp": -torch.rand(rows, length, generator=gen) * 2,
                "rollout_logp": -torch.rand(rows, length, generator=gen) * 2,
                "teacher_logp": -torch.rand(rows, length, generator=gen) * 3,
                "advantages": torch.randn(rows, generator=gen),
                "domain_ids": torch.randint(0, 2, (rows,), generator=gen),
            }
        )
    return batches


def fuse_on_rank(payload: Any = None) -> dict[str, Any]:
    """Per layout, two RL steps (so that the SAF schedule's second multiplier is compared too). ``dp``: rank r
    holds every other micro-batch; ``pp``: rank 0 is a first stage (no old_logp), rank 1 holds them all."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for layout in ("dp", "pp"):
        step = DistillStep(distill_config(SAF), DOMAINS)
        out[layout] = {"metrics": [], "advantages": []}
        for seed in (0, 1):
            batches = make_batches(seed)
            if layout == "dp":
                mine = batches[rank::2]
            else:
                mine = (
                    batches
                    if rank == 1
                    else [{k: v for k, v in b.items() if k != "old_logp"} for b in batches]
                )
            out[layout]["metrics"].append(step.fuse([mine[:1], mine[1:]]))
            out[layout]["advantages"].append([b["advantages"] for b in mine])
    return out
