"""Per-process bodies of the RL tests (run in spawned processes so Megatron's global state stays out of pytest)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sapo_megatron.config import config_from_dict
from sapo_megatron.megatron.loss_hook import LogprobOutput
from sapo_megatron.megatron.parallel import init_parallel
from sapo_megatron.megatron.routing import capture_routing, routing_agreement
from sapo_megatron.megatron.train_step import TrainEngine
from sapo_megatron.model.batching import TrainSequence, build_micro_batches
from sapo_megatron.rollout.cpu.engine import CPUEngine
from sapo_megatron.rollout.cpu.server import CPUServer
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams


def engine_vs_trainer(payload: dict[str, Any]) -> dict[str, Any]:
    """Sample over HTTP from the CPU server, then score the same tokens with the Megatron trainer."""
    hf_dir = payload["hf_dir"]
    cfg = config_from_dict({"model": {"hf_config": hf_dir, "init": "hf", "init_path": hf_dir}})
    init_parallel(cfg.parallel, seed=0, cfg=cfg, cpu_threads=1)
    arch = cfg.model.arch
    with CPUServer(CPUEngine.from_pretrained(hf_dir, seed=3, num_threads=1)) as server:
        client = SGLangClient([server.url], num_layers=arch.num_hidden_layers, top_k=arch.num_experts_per_tok)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=11)
        prompts = [[3, 17, 5, 9], [40, 2, 8], [21, 22, 23, 24, 25], [7]]
        requests = [
            GenerationRequest(prompt_ids=p, n=4, sampling=sampling, return_routed_experts=True, group_id=i)
            for i, p in enumerate(prompts)
        ]
        samples = [s for group in client.generate(requests) for s in group]
    engine = TrainEngine(cfg)
    sequences = [TrainSequence(s.prompt_ids, s.response_ids, 0.0, s.rollout_logp) for s in samples]
    (batch,) = build_micro_batches(sequences, dp_rank=0, dp_size=1, micro_batches=1, pad_id=0)
    with capture_routing(engine.module, batch_size=len(samples)) as routes:
        (logp,) = engine.forward_only([batch], LogprobOutput())
    mask = batch["loss_mask"].bool()
    delta = (logp - batch["rollout_logp"])[mask].abs()
    trainer_routes = torch.stack(routes.layers, dim=2).numpy()  # [b, s, layers, k]
    agreements = []
    for row, sample in enumerate(samples):
        fed = len(sample.prompt_ids) + len(sample.response_ids) - 1
        agreements.append(routing_agreement(sample.routed_experts, trainer_routes[row, :fed]))
    return {
        "max_abs_delta": float(delta.max()),
        "mean_abs_delta": float(delta.mean()),
        "tokens": int(mask.sum()),
        "routing_agreement": float(np.mean(agreements)),
        "route_shapes": [tuple(s.routed_experts.shape) for s in samples],
        "lengths": [len(s.prompt_ids) + len(s.response_ids) for s in samples],
    }
