"""Per-rank bodies of the distillation-step tests (spawned over gloo by tests/distributed.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sapo_megatron.config import config_from_dict
from sapo_megatron.distill.step import DistillStep
from sapo_megatron.model.step_batch import MicroBatch, StepBatch
from sapo_megatron.model.tiny import tiny_hf_config

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


def fuse(step: DistillStep, updates: list[list[MicroBatch]]) -> dict[str, float]:
    """The teacher-fusion pass as an RL step runs it: its part applied to the micro-batches; the step metrics."""
    batch = StepBatch(updates)
    return batch.add(step.fuse(batch))


def make_batches(seed: int = 0, count: int = 4, rows: int = 3, length: int = 7) -> list[MicroBatch]:
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
            MicroBatch(
                input_ids=torch.zeros(rows, length, dtype=torch.long),
                loss_mask=mask,
                old_logp=-torch.rand(rows, length, generator=gen) * 2,
                rollout_logp=-torch.rand(rows, length, generator=gen) * 2,
                teacher_logp=-torch.rand(rows, length, generator=gen) * 3,
                advantages=torch.randn(rows, generator=gen),
                domain_ids=torch.randint(0, 2, (rows,), generator=gen),
            )
        )
    return batches


def fuse_on_rank(payload: Any = None) -> dict[str, Any]:
    """Per layout, two RL steps (so that the SAF schedule's second multiplier is compared too). ``dp``: rank r
    holds every other micro-batch; ``pp``: rank 0 is a first stage (no old_logp), rank 1 holds them all."""
    if not dist.is_initialized():
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
                    else [MicroBatch.of({k: v for k, v in b.items() if k != "old_logp"}) for b in batches]
                )
            out[layout]["metrics"].append(fuse(step, [mine[:1], mine[1:]]))
            out[layout]["advantages"].append([b["advantages"] for b in mine])
    return out


def two_ranks(payload: dict[str, Any]) -> dict[str, Any]:
    """Both scenarios in one pair of processes (a spawn costs seconds): the alignment check on a data-parallel
    Megatron trainer, then the fusion layouts over the same process group."""
    return {"alignment": alignment(payload), "layouts": fuse_on_rank(), "gathered": gathered_ratios()}


def gathered_ratios() -> list[float]:
    """The step's token ratios pooled over the 2 data-parallel ranks (Megatron's state from ``alignment``):
    rank r holds r + 1 values r + 0.5."""
    from sapo_megatron.megatron.step_stats import gather_token_values

    rank = dist.get_rank()
    local = [torch.full((rank + 1,), rank + 0.5), torch.zeros(0)]
    return gather_token_values(local).tolist()


def alignment(payload: dict[str, Any]) -> dict[str, float]:
    """A teacher identical to the student: the CPU engine samples and scores (the teacher path), the Megatron
    trainer (data-parallel over the ranks) computes old_logp at the same weights, the distillation step fuses.
    Also the same teacher values laid one position off (a misaligned span) for contrast."""
    from dataclasses import replace

    from sapo_megatron.distill.config import TeacherConfig
    from sapo_megatron.distill.teachers import Teacher
    from sapo_megatron.megatron.loss_hook import LogprobOutput
    from sapo_megatron.megatron.parallel import init_parallel
    from sapo_megatron.megatron.train_step import TrainEngine
    from sapo_megatron.model.batching import TrainSequence, build_micro_batches
    from sapo_megatron.rollout.cpu.engine import CPUEngine
    from sapo_megatron.rollout.types import GenerationRequest, SamplingParams

    hf_dir = payload["hf_dir"]
    cfg = config_from_dict(
        {
            "model": {"hf_config": hf_dir, "init": "hf", "init_path": hf_dir},
            "teachers": [{"name": "self", "model_path": hf_dir}],
            "algorithm": {"fusion": {"mode": "opd"}},
            "launch": {"procs_per_node": payload["world"]},
        }
    )
    info = init_parallel(cfg.parallel, seed=0, cfg=cfg, cpu_threads=1)
    engine = CPUEngine.from_pretrained(hf_dir, seed=5, num_threads=1)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=9)
    prompts = [[1, 17, 5, 9], [1, 40, 8], [1, 21, 22, 23, 24, 25], [1, 7]]
    requests = [
        GenerationRequest(prompt_ids=p, n=2, sampling=sampling, group_id=i) for i, p in enumerate(prompts)
    ]
    samples = [s for group in engine.generate(requests) for s in group]
    teacher_logp = Teacher(TeacherConfig(name="self", model_path=hf_dir), engine).score(samples)
    sequences = [
        TrainSequence(s.prompt_ids, s.response_ids, 0.0, s.rollout_logp, teacher_logp=t)
        for s, t in zip(samples, teacher_logp)
    ]
    shifted = [replace(seq, teacher_logp=[*seq.teacher_logp[1:], seq.teacher_logp[0]]) for seq in sequences]
    trainer = TrainEngine(cfg)
    out = {}
    for layout, budget in (("", None), ("packed_", 16)):  # packed: several [1, T] micro-batches per rank
        for name, seqs in (("aligned", sequences), ("shifted", shifted)):
            batches = build_micro_batches(
                seqs,
                dp_rank=info.dp_rank,
                dp_size=info.dp_size,
                micro_batches=1,
                pad_id=0,
                max_tokens_per_micro_batch=budget,
            )
            for batch in batches:
                (batch["old_logp"],) = trainer.forward_only([batch], LogprobOutput())
            metrics = fuse(DistillStep(cfg), [batches])
            fused = torch.cat([b["advantages"][b["loss_mask"].bool()] for b in batches])
            out[f"{layout}{name}_max_abs"] = float(fused.abs().max())
            out[f"{layout}{name}_min_abs"] = float(fused.abs().min())
            out[f"{layout}{name}_kl"] = metrics["opd/reverse_kl"]
            out[f"{layout}tokens"] = int(fused.numel())
    out.update(_sampled_hot(payload, trainer, engine, prompts, info))
    return out


def _sampled_hot(payload: dict[str, Any], trainer, engine, prompts, info) -> dict[str, float]:
    """Rollout temperature 0.7: teachers (in-process and served over HTTP) score at temperature 1, and the RL
    step's own old-log-prob pass (RoutingStep) gives the student's log-prob at 1 for A_opd; the log-prob at 0.7
    (what the PPO ratio uses) would leave an identical teacher a clear gap."""
    from sapo_megatron.algo import opd_advantages
    from sapo_megatron.distill.config import TeacherConfig
    from sapo_megatron.distill.teachers import Teacher
    from sapo_megatron.loop.old_policy import old_policy_logp
    from sapo_megatron.loop.replay import RoutingStep
    from sapo_megatron.model.batching import TrainSequence, build_micro_batches
    from sapo_megatron.rollout.cpu.engine import CPUEngine
    from sapo_megatron.rollout.cpu.server import CPUServer
    from sapo_megatron.rollout.sglang.client import SGLangClient
    from sapo_megatron.rollout.types import GenerationRequest, SamplingParams

    hf_dir = payload["hf_dir"]
    cfg = config_from_dict(
        {
            "model": {"hf_config": hf_dir, "init": "hf", "init_path": hf_dir},
            "teachers": [{"name": "self", "model_path": hf_dir}],
            "algorithm": {"fusion": {"mode": "opd"}},
            "rollout": {"temperature": 0.7},
            "launch": {"procs_per_node": payload["world"]},
        }
    )
    sampling = SamplingParams(temperature=0.7, max_new_tokens=8, seed=11)
    requests = [
        GenerationRequest(prompt_ids=p, n=2, sampling=sampling, group_id=i) for i, p in enumerate(prompts)
    ]
    samples = [s for group in engine.generate(requests) for s in group]
    teacher_cfg = TeacherConfig(name="self", model_path=hf_dir)
    with CPUServer(CPUEngine.from_pretrained(hf_dir, seed=5, num_threads=1)) as server:
        scored = {
            "in_process": Teacher(teacher_cfg, engine).score(samples),
            "served": Teacher(teacher_cfg, SGLangClient([server.url])).score(samples),
        }
    out = {}
    for where, teacher_logp in scored.items():
        sequences = [
            TrainSequence(s.prompt_ids, s.response_ids, 0.0, s.rollout_logp, teacher_logp=t)
            for s, t in zip(samples, teacher_logp)
        ]
        batches = build_micro_batches(
            sequences, dp_rank=info.dp_rank, dp_size=info.dp_size, micro_batches=1, pad_id=0
        )
        step = StepBatch([batches])
        step.add(
            old_policy_logp(
                RoutingStep(trainer, cfg), step, temperature=cfg.rollout.temperature, unit_temperature=True
            )
        )
        at_sampling = [
            opd_advantages(b["teacher_logp"], b["old_logp"], b["loss_mask"]).abs().max() for b in batches
        ]
        fuse(DistillStep(cfg), [batches])
        fused = torch.cat([b["advantages"][b["loss_mask"].bool()] for b in batches])
        out[f"hot_{where}_max_abs"] = float(fused.abs().max())
        out[f"hot_{where}_at_sampling_temperature_max_abs"] = float(max(at_sampling))
    return out
