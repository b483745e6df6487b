"""Per-rank parameter counts and static memory (weights, gradients, optimizer state) from the architecture alone.

The counts follow Megatron's sharding: attention and dense MLP split over TP, the vocabulary split over TP
(embedding on the first pipeline stage, output layer on the last), experts split over EP then expert-TP, norms
and the router replicated. A vision-language model's vision tower sits whole on every rank of the first stage
(replicated over TP, like slime's); ``model.freeze_vision`` leaves it without gradients or optimizer state.
A test checks the counts against models Megatron builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from sapo_megatron.config import RunConfig, data_parallel_size
from sapo_megatron.model.arch import QwenArch

BYTES_PER_PARAM = {"fp32": 4, "bf16": 2, "fp8": 2}


@dataclass(frozen=True)
class StageShard:
    """Parameters held by one rank of a pipeline stage (every TP/EP rank of a stage holds the same count)."""

    pp_rank: int
    layers: tuple[int, int]  # first, last+1 (global indices)
    dense_params: int  # everything but the experts, embeddings included
    expert_params: int
    embedding_params: int = 0  # of dense_params: input embedding, output layer, final norm
    vision_params: int = 0  # of dense_params: the vision tower and its mergers (first stage)
    frozen_params: int = 0  # of dense_params: parameters without gradients (a frozen vision tower)

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params

    @property
    def trained_params(self) -> int:
        return self.params - self.frozen_params


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
        embedding = _embedding_params(arch, cfg, first_stage=stage == 0, last_stage=stage == par.pp - 1)
        vision = arch.vision.num_parameters() if arch.vision is not None and stage == 0 else 0
        frozen = vision if cfg.model.freeze_vision else 0
        out.append(
            StageShard(stage, (first, last), dense + embedding + vision, experts, embedding, vision, frozen)
        )
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


@dataclass(frozen=True)
class StaticMemory:
    """Static memory of one rank in bytes (activations excluded)."""

    weights: int
    grads: int
    optimizer: int
    reference: int  # the frozen reference policy (algorithm.loss.kl_coef > 0), weights only

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.reference


def memory_estimate(cfg: RunConfig, shard: StageShard, world_size: int) -> StaticMemory:
    """Weights in the model dtype (decoder GEMM weights in 1 byte under ``precision.fp8_param_gather``), fp32
    gradient buffers (Megatron DDP with ``grad_reduce_in_fp32``), Adam state (fp32 master copy for bf16/fp8 + 2
    moments) divided over the data-parallel replicas when the distributed optimizer is on, and the reference
    policy's weights when the loss has a KL term."""
    dtype = cfg.precision.dtype
    weights = shard.params * BYTES_PER_PARAM[dtype]
    if dtype == "fp8" and cfg.precision.fp8_param_gather:
        weights -= shard.params - shard.embedding_params  # norms and routers stay bf16: a few MB, ignored
    grads = shard.trained_params * 4
    state_per_param = (8 if cfg.optimizer.name == "adam" else 4) + (4 if dtype != "fp32" else 0)
    dp = data_parallel_size(cfg, world_size)
    expert_dp = max(1, world_size // (cfg.parallel.ep * cfg.parallel.etp * cfg.parallel.pp))
    trained_dense = shard.dense_params - shard.frozen_params
    if cfg.optimizer.use_distributed_optimizer:
        optimizer = trained_dense * state_per_param // dp + shard.expert_params * state_per_param // expert_dp
    else:
        optimizer = shard.trained_params * state_per_param
    reference = shard.params * BYTES_PER_PARAM[dtype] if cfg.algorithm.loss.kl_coef > 0 else 0
    return StaticMemory(weights, grads, optimizer, reference)
