"""The plan of one layout: per pipeline stage, static memory + activations + the colocated rollout engine's share
against the GPU, with a fits / does-not-fit verdict; as text (``plan``, ``train --dry-run``) or as JSON
(``plan --json``, shape documented in docs/planning.md and fixed by ``PLAN_SCHEMA``).

Budget of one GPU: ``memory - reserved - rollout``, where ``reserved`` = 2 GiB (CUDA context, NCCL communicators,
cuBLAS/TE workspaces) + 5% of the memory (allocator fragmentation), and ``rollout`` = the fraction SGLang keeps
(``--mem-fraction-static``) when ``rollout.colocation: split`` (a fixed split: the engine
keeps its memory while the trainer trains). A stage fits when weights + gradients + optimizer + reference +
activations ≤ budget.

With ``rollout.colocation: time_shared`` the GPU is time-shared (sapo_megatron/loop/colocation.py): the engine releases all of
its memory while the trainer trains, and the offloaded trainer leaves only what stays resident while the engine
generates. The budget is then ``memory - reserved`` for both phases, and a stage fits when
``max(train phase, rollout phase) ≤ budget``: train phase = the stage's total; rollout phase = the engine's
fraction + what stays resident (the reference model, one tensor-sync bucket, and weights + gradients + optimizer
when ``offload_trainer`` is off). The sync itself holds the trainer's weights and a bucket beside the engine's
weights with its KV cache still released, which the rollout phase bounds while the trainer's weights per GPU
are below the engine's KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sapo_megatron.config import RunConfig, data_parallel_size, sequence_length_multiple
from sapo_megatron.model.precision import GPU_TYPES
from sapo_megatron.plan.activations import (
    MicroBatchShape,
    Spec,
    StageActivations,
    micro_batch_shape,
    planned_prompt_tokens,
    stage_activations,
)
from sapo_megatron.plan.static import StageShard, StaticMemory, memory_estimate, stage_shards

GIB = 1024**3
PLAN_SCHEMA = "sapo-megatron.plan/1"
RESERVED_GIB = 2.0
FRAGMENTATION = 0.05
DEFAULT_GPU_MEMORY_GIB = 80.0
DEFAULT_COLOCATED_FRACTION = (
    0.5  # when rollout.colocation is not none and no --rollout-mem-fraction: a typical colocated value
)


@dataclass(frozen=True)
class PlanSettings:
    """What the planner assumes beyond the config."""

    world_size: int
    gpu_memory_gib: float | None = None  # None: launch.gpu_type's memory, else 80
    prompt_tokens: int = 512  # prompt length of the padded micro-batch (responses: rollout.max_new_tokens)
    rollout_mem_fraction: float | None = None  # None: 0.5 when the engine shares the GPUs, else 0
    spec: Spec = "te"
    image_patches: int = 0  # ViT patches per micro-batch (vision-language models; before the merge)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's ranks (all of its TP/EP/DP ranks hold the same amounts)."""

    shard: StageShard
    static: StaticMemory
    activations: StageActivations
    budget: float
    rollout_phase: float | None = (
        None  # time-shared (rollout.colocation: time_shared): engine share + what stays resident
    )

    @property
    def train_phase(self) -> float:
        return self.static.total + self.activations.total

    @property
    def total(self) -> float:
        """The stage's peak: the train phase, or the larger phase when the GPU is time-shared."""
        return max(self.train_phase, self.rollout_phase or 0.0)

    @property
    def headroom(self) -> float:
        return self.budget - self.total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0


@dataclass(frozen=True)
class Plan:
    cfg: RunConfig
    settings: PlanSettings
    shape: MicroBatchShape
    gpu_memory: float
    reserved: float
    rollout: float
    stages: list[StagePlan] = field(default_factory=list)

    @property
    def budget(self) -> float:
        return self.gpu_memory - self.reserved - self.rollout

    @property
    def fits(self) -> bool:
        return all(stage.fits for stage in self.stages)

    @property
    def peak(self) -> float:
        return max(stage.total for stage in self.stages)


def gpu_memory_gib(cfg: RunConfig, given: float | None) -> float:
    if given is not None:
        return given
    gpu = GPU_TYPES.get(cfg.launch.gpu_type or "")
    return gpu.memory_gib if gpu else DEFAULT_GPU_MEMORY_GIB


def rollout_fraction(cfg: RunConfig, given: float | None) -> float:
    """The share of a GPU the rollout engine keeps: SGLang servers on the trainer's GPUs (a CPU engine keeps
    none of the GPU's memory)."""
    on_gpus = cfg.rollout.shares_devices and cfg.rollout.engine == "sglang"
    if given is not None:
        return given if on_gpus else 0.0
    return DEFAULT_COLOCATED_FRACTION if on_gpus else 0.0


def build_plan(cfg: RunConfig, settings: PlanSettings) -> Plan:
    """The plan of ``cfg``'s layout on ``settings.world_size`` GPUs (the layout must be valid for it)."""
    memory = gpu_memory_gib(cfg, settings.gpu_memory_gib) * GIB
    reserved = RESERVED_GIB * GIB + FRAGMENTATION * memory
    engine = rollout_fraction(cfg, settings.rollout_mem_fraction) * memory
    time_shared = cfg.rollout.time_shared is not None
    rollout = 0.0 if time_shared else engine  # time-shared: the engine is released while the trainer trains
    shape = micro_batch_shape(cfg, settings.world_size, settings.prompt_tokens)
    budget = memory - reserved - rollout
    stages = []
    for shard in stage_shards(cfg):
        static = memory_estimate(cfg, shard, settings.world_size)
        activations = stage_activations(
            cfg, shape, shard.pp_rank, shard.layers, spec=settings.spec, image_patches=settings.image_patches
        )
        phase = engine + resident_while_generating(cfg, static) if time_shared else None
        stages.append(StagePlan(shard, static, activations, budget, phase))
    return Plan(cfg, settings, shape, memory, reserved, rollout, stages)


def resident_while_generating(cfg: RunConfig, static: StaticMemory) -> float:
    """What a time-shared trainer keeps on the GPU while the engine generates: the reference model, one sync
    bucket, and everything else when it is not offloaded."""
    colocate = cfg.rollout.time_shared
    assert colocate is not None
    kept = static.reference + colocate.bucket_mb * 1024**2
    if not colocate.offload_trainer:
        kept += static.weights + static.grads + static.optimizer
    return kept


# ------------------------------------------------------------------------------------------------------------
# Text
# ------------------------------------------------------------------------------------------------------------


def _human_count(count: int) -> str:
    return f"{count / 1e9:.3f} B" if count >= 1e9 else f"{count / 1e6:.3f} M"


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def format_plan(plan: Plan) -> str:
    """A human-readable report: model, layout, micro-batch, per-stage memory and the verdict."""
    cfg = plan.cfg
    lines = [*_header_lines(cfg, plan), "", *_stage_table(plan), "", *_verdict_lines(plan)]
    return "\n".join(lines)


def _header_lines(cfg: RunConfig, plan: Plan) -> list[str]:
    arch, par, world = cfg.model.arch, cfg.parallel, plan.settings.world_size
    dp = data_parallel_size(cfg, world)
    shape = plan.shape
    model = (
        f", {arch.num_experts} experts top-{arch.num_experts_per_tok} (ffn {arch.moe_intermediate_size})"
        if arch.is_moe
        else f", ffn {arch.intermediate_size}"
    )
    recompute = cfg.model.recompute + (
        f" {cfg.model.selective_modules}" if cfg.model.recompute == "selective" else ""
    )
    precision = cfg.precision
    fp8 = ""
    if precision.dtype == "fp8":
        fp8 = f" (recipe {precision.fp8_recipe}, format {precision.fp8_format_resolved}"
        fp8 += ", fp8 weights gathered)" if precision.fp8_param_gather else ")"
    batch = (
        f"packed: {shape.tokens:,} tokens"
        if shape.packed
        else f"{shape.sequences} sequence{'s' if shape.sequences != 1 else ''} x {shape.seq_len:,} tokens (prompt {planned_prompt_tokens(cfg, plan.settings.prompt_tokens)} + "
        f"rollout.max_new_tokens {cfg.rollout.max_new_tokens}, padded to a multiple of "
        f"{sequence_length_multiple(cfg)}) = {shape.tokens:,} tokens"
    )
    return [
        f"model: {arch.model_type}, {arch.num_hidden_layers} layers, hidden {arch.hidden_size}, "
        f"{arch.num_attention_heads} q / {arch.num_key_value_heads} kv heads × {arch.head_dim}, "
        f"vocab {arch.vocab_size}{model}",
        f"total parameters: {_human_count(arch.num_parameters())}" + _vision_line(cfg, plan),
        f"world size {world} = tp {par.tp} × pp {par.pp} × cp {par.cp} × dp {dp}; experts: ep {par.ep} × etp "
        f"{par.etp}; sequence parallel: {par.sequence_parallel}; micro-batches {par.micro_batches}",
        f"precision {precision.dtype}{fp8}; optimizer {cfg.optimizer.name}, distributed: "
        f"{cfg.optimizer.use_distributed_optimizer}; recompute {recompute}",
        f"micro-batch: {batch}; activations counted for the {plan.settings.spec} layer spec",
        f"GPU {plan.gpu_memory / GIB:.1f} GiB - reserved {_gib(plan.reserved)} (CUDA context, NCCL, "
        f"fragmentation) - colocated rollout {_gib(plan.rollout)} = {_gib(plan.budget)} GiB per rank",
        *_time_sharing_line(cfg, plan),
    ]


def _time_sharing_line(cfg: RunConfig, plan: Plan) -> list[str]:
    if cfg.rollout.time_shared is None:
        return []
    fraction = rollout_fraction(cfg, plan.settings.rollout_mem_fraction)
    stage = max(plan.stages, key=lambda s: s.total)
    return [
        f"time-shared (rollout.colocation): peak = max(train phase {_gib(stage.train_phase)}, rollout phase "
        f"{_gib(stage.rollout_phase or 0.0)} = engine {fraction:.2f} of the GPU + resident trainer "
        f"{_gib((stage.rollout_phase or 0.0) - fraction * plan.gpu_memory)}) GiB on stage {stage.shard.pp_rank}",
    ]


def _vision_line(cfg: RunConfig, plan: Plan) -> str:
    vision = cfg.model.arch.vision
    if vision is None:
        return ""
    frozen = ", frozen" if cfg.model.freeze_vision else ""
    return (
        f" (vision tower {_human_count(vision.num_parameters())} on stage 0, replicated over TP{frozen}; "
        f"{plan.settings.image_patches:,} ViT patches per micro-batch)"
    )


def _stage_table(plan: Plan) -> list[str]:
    lines = [
        f"{'stage':>5} {'layers':>9} {'params/rank':>14} {'of which experts':>17} {'weights':>8} {'grads':>7} "
        f"{'optim':>7} {'ref':>6} {'activ.':>7} {'total':>7} {'budget':>7}  verdict (GiB)",
    ]
    for stage in plan.stages:
        shard, mem, act = stage.shard, stage.static, stage.activations
        verdict = "fits" if stage.fits else "DOES NOT FIT"
        lines.append(
            f"{shard.pp_rank:>5} {shard.layers[0]:>4}-{shard.layers[1] - 1:<4} {shard.params:>14,} "
            f"{shard.expert_params:>17,} {_gib(mem.weights):>8} {_gib(mem.grads):>7} {_gib(mem.optimizer):>7} "
            f"{_gib(mem.reference):>6} {_gib(act.total):>7} {_gib(stage.total):>7} {_gib(stage.budget):>7}  "
            f"{verdict} ({_gib(stage.headroom)} {'left' if stage.fits else 'over'})"
        )
    return lines


def _verdict_lines(plan: Plan) -> list[str]:
    first = plan.stages[0].activations
    layers = ", ".join(f"{kind} layer {_gib(value)}" for kind, value in sorted(first.layers.items()))
    lines = [
        f"activations, stage 0: {first.in_flight} micro-batch{'es' if first.in_flight != 1 else ''} in flight × "
        f"{_gib(first.per_micro_batch)} GiB "
        f"({layers}) + backward working memory {_gib(first.transient)} GiB",
        "verdict: fits in memory on every rank"
        if plan.fits
        else "verdict: DOES NOT FIT – raise tp/pp/ep, recompute (model.recompute), or shrink the micro-batch "
        "(parallel.micro_batches, packing); `sapo-megatron plan CONFIG --suggest` lists layouts that fit",
        "(estimate: docs/planning.md lists what it counts; measured error on CPU: bench/bench_planner.py)",
    ]
    return lines


# ------------------------------------------------------------------------------------------------------------
# JSON
# ------------------------------------------------------------------------------------------------------------


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The plan as a JSON-ready mapping; the keys are the stable contract of ``plan --json`` (``PLAN_SCHEMA``)."""
    cfg = plan.cfg
    arch, shape, precision = cfg.model.arch, plan.shape, cfg.precision
    return {
        "schema": PLAN_SCHEMA,
        "name": cfg.name,
        "model": {
            "model_type": arch.model_type,
            "layers": arch.num_hidden_layers,
            "hidden_size": arch.hidden_size,
            "experts": arch.num_experts,
            "parameters": arch.num_parameters(),
        },
        "world_size": plan.settings.world_size,
        "layout": layout_json(cfg, plan.settings.world_size),
        "precision": {
            "dtype": precision.dtype,
            "fp8_recipe": precision.fp8_recipe if precision.dtype == "fp8" else None,
            "fp8_format": precision.fp8_format_resolved if precision.dtype == "fp8" else None,
            "fp8_param_gather": precision.dtype == "fp8" and precision.fp8_param_gather,
        },
        "micro_batch": {
            "sequences": shape.sequences,
            "seq_len": shape.seq_len,
            "tokens": shape.tokens,
            "packed": shape.packed,
            "length_multiple": sequence_length_multiple(cfg),
        },
        "spec": plan.settings.spec,
        "gpu": {
            "memory_gib": _r(plan.gpu_memory),
            "reserved_gib": _r(plan.reserved),
            "rollout_gib": _r(plan.rollout),
            "budget_gib": _r(plan.budget),
        },
        "stages": [_stage_json(stage) for stage in plan.stages],
        "peak_gib": _r(plan.peak),
        "fits": plan.fits,
    }


def layout_json(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    par = cfg.parallel
    return {
        "tp": par.tp,
        "pp": par.pp,
        "cp": par.cp,
        "dp": data_parallel_size(cfg, world_size),
        "ep": par.ep,
        "etp": par.etp,
        "sequence_parallel": par.sequence_parallel,
        "micro_batches": par.micro_batches,
        "recompute": cfg.model.recompute,
        "recompute_modules": cfg.model.selective_modules,
    }


def _stage_json(stage: StagePlan) -> dict[str, Any]:
    shard, mem, act = stage.shard, stage.static, stage.activations
    return {
        "pp_rank": shard.pp_rank,
        "layers": [shard.layers[0], shard.layers[1]],
        "params": shard.params,
        "expert_params": shard.expert_params,
        "memory_gib": {
            "weights": _r(mem.weights),
            "grads": _r(mem.grads),
            "optimizer": _r(mem.optimizer),
            "reference": _r(mem.reference),
            "activations": _r(act.total),
            "total": _r(stage.train_phase),
        },
        "phases_gib": {  # rollout: null unless rollout.colocation time-shares the GPU; peak = the larger
            "train": _r(stage.train_phase),
            "rollout": None if stage.rollout_phase is None else _r(stage.rollout_phase),
            "peak": _r(stage.total),
        },
        "activations": {
            "in_flight": act.in_flight,
            "per_micro_batch_gib": _r(act.per_micro_batch),
            "transient_gib": _r(act.transient),
            "per_layer_gib": {kind: _r(value) for kind, value in sorted(act.layers.items())},
        },
        "headroom_gib": _r(stage.headroom),
        "fits": stage.fits,
    }


def _r(value: float) -> float:
    return round(value / GIB, 3)
