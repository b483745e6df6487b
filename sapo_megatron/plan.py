"""Per-rank parameter counts and memory for a parallel layout, computed from the architecture alone.

What ``sapo-megatron train CONFIG --dry-run`` prints, so a Qwen3-30B-A3B layout can be checked on a laptop before
a cluster is booked. The counts follow Megatron's sharding: attention and dense MLP split over TP, the
vocabulary split over TP (embedding on the first pipeline stage, output layer on the last), experts split over
EP then expert-TP, norms and the router replicated. A test checks them against models Megatron builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from sapo_megatron.arch import QwenArch
from sapo_megatron.config import RunConfig, data_parallel_size

BYTES_PER_PARAM = {"fp32": 4, "bf16": 2, "fp8": 2}
GIB = 1024**3


@dataclass(frozen=True)
class StageShard:
    """Parameters held by one rank of a pipeline stage (every TP/EP rank of a stage holds the same count)."""

    pp_rank: int
    layers: tuple[int, int]  # first, last+1 (global indices)
    dense_params: int
    expert_params: int

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params


def stage_shards(cfg: RunConfig) -> list[StageShard]:
    """One entry per pipeline stage."""
    arch, par = cfg.model.arch, cfg.parallel
    per_stage = arch.num_hidden_layers // par.pp
    pattern = arch.moe_layer_pattern()
    out = []
    for stage in range(par.pp):
        first, last = stage * per_stage, (stage + 1) * per_stage
        dense = sum(_layer_dense_params(arch, cfg, pattern[i]) for i in range(first, last))
        experts = sum(_layer_expert_params(arch, cfg) for i in range(first, last) if pattern[i])
        dense += _embedding_params(arch, cfg, first_stage=stage == 0, last_stage=stage == par.pp - 1)
        out.append(StageShard(stage, (first, last), dense, experts))
    return out


def _layer_dense_params(arch: QwenArch, cfg: RunConfig, is_moe: int) -> int:
    tp, h, hd = cfg.parallel.tp, arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    attention = (h * (q + 2 * kv) + q * h) // tp + 2 * hd + 2 * h
    if is_moe:
        return attention + arch.num_experts * h
    return attention + 3 * h * arch.intermediate_size // tp


def _layer_expert_params(arch: QwenArch, cfg: RunConfig) -> int:
    per_expert = 3 * arch.hidden_size * arch.moe_intermediate_size // cfg.parallel.etp
    return per_expert * arch.num_experts // cfg.parallel.ep


def _embedding_params(arch: QwenArch, cfg: RunConfig, *, first_stage: bool, last_stage: bool) -> int:
    shard = arch.vocab_size * arch.hidden_size // cfg.parallel.tp
    params = shard if first_stage else 0
    if last_stage:
        params += arch.hidden_size  # final norm
        if not arch.tie_word_embeddings or not first_stage:
            params += shard
    return params


def _human_count(count: int) -> str:
    return f"{count / 1e9:.3f} B" if count >= 1e9 else f"{count / 1e6:.3f} M"


@dataclass(frozen=True)
class MemoryEstimate:
    """Static memory of one rank in bytes (activations excluded)."""

    weights: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def memory_estimate(cfg: RunConfig, shard: StageShard, world_size: int) -> MemoryEstimate:
    """Weights in the model dtype, fp32 gradient buffers, Adam state (fp32 master copy for bf16 + 2 moments),
    divided over the data-parallel replicas when the distributed optimizer is on."""
    dtype = cfg.precision.dtype
    weights = shard.params * BYTES_PER_PARAM[dtype]
    grads = shard.params * 4
    state_per_param = (8 if cfg.optimizer.name == "adam" else 4) + (4 if dtype != "fp32" else 0)
    dp = data_parallel_size(cfg, world_size)
    expert_dp = max(1, world_size // (cfg.parallel.ep * cfg.parallel.etp * cfg.parallel.pp))
    if cfg.optimizer.use_distributed_optimizer:
        optimizer = (
            shard.dense_params * state_per_param // dp + shard.expert_params * state_per_param // expert_dp
        )
    else:
        optimizer = shard.params * state_per_param
    return MemoryEstimate(weights, grads, optimizer)


def format_plan(cfg: RunConfig, world_size: int) -> str:
    """A human-readable report of the layout, per-stage parameters and static memory per rank."""
    arch, par = cfg.model.arch, cfg.parallel
    dp = data_parallel_size(cfg, world_size)
    lines = [
        f"model: {arch.model_type}, {arch.num_hidden_layers} layers, hidden {arch.hidden_size}, "
        f"{arch.num_attention_heads} q / {arch.num_key_value_heads} kv heads × {arch.head_dim}, "
        f"vocab {arch.vocab_size}"
        + (
            f", {arch.num_experts} experts top-{arch.num_experts_per_tok} (ffn {arch.moe_intermediate_size})"
            if arch.is_moe
            else f", ffn {arch.intermediate_size}"
        ),
        f"total parameters: {_human_count(arch.num_parameters())}",
        f"world size {world_size} = tp {par.tp} × pp {par.pp} × cp {par.cp} × dp {dp}; "
        f"experts: ep {par.ep} × etp {par.etp}; sequence parallel: {par.sequence_parallel}; "
        f"micro-batches {par.micro_batches}",
        f"precision {cfg.precision.dtype}"
        + (f" (recipe {cfg.precision.fp8_recipe})" if cfg.precision.dtype == "fp8" else "")
        + f"; optimizer {cfg.optimizer.name}, distributed: {cfg.optimizer.use_distributed_optimizer}",
        "",
        f"{'stage':>5} {'layers':>9} {'params/rank':>14} {'of which experts':>17} "
        f"{'weights GiB':>12} {'grads GiB':>10} {'optim GiB':>10} {'total GiB':>10}",
    ]
    for shard in stage_shards(cfg):
        mem = memory_estimate(cfg, shard, world_size)
        lines.append(
            f"{shard.pp_rank:>5} {shard.layers[0]:>4}-{shard.layers[1] - 1:<4} {shard.params:>14,} "
            f"{shard.expert_params:>17,} {mem.weights / GIB:>12.2f} {mem.grads / GIB:>10.2f} "
            f"{mem.optimizer / GIB:>10.2f} {mem.total / GIB:>10.2f}"
        )
    lines.append(
        "(static memory only: activations, the rollout engine and communication buffers come on top)"
    )
    return "\n".join(lines)
