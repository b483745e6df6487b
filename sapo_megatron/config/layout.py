"""The parallel layout against the model and the world size: heads, experts and layers split evenly, every
optimizer step splits into data-parallel ranks × micro-batches, packed micro-batches hold the longest sequence.
Checked once the world size is known (``train``, ``--dry-run``, ``plan``), before any process group forms."""

from __future__ import annotations

from sapo_megatron.config.run import RunConfig
from sapo_megatron.errors import ConfigError
from sapo_megatron.model.arch import QwenArch
from sapo_megatron.model.config import ParallelConfig
from sapo_megatron.model.precision import FP8_RECIPES


def validate_layout(cfg: RunConfig, world_size: int) -> None:
    """Check the parallel layout against the model and the world size; raise :class:`ConfigError`."""
    problems = _layout_problems(cfg, world_size)
    if problems:
        raise ConfigError("invalid parallel layout:\n" + "\n".join(f"  - {p}" for p in problems))


def data_parallel_size(cfg: RunConfig, world_size: int) -> int:
    return world_size // cfg.parallel.model_parallel_size


def sequence_length_multiple(cfg: RunConfig) -> int:
    """What every micro-batch's padded sequence length (and every packed slot) must be a multiple of: the
    tensor-parallel size under sequence parallelism (the sequence is split over TP ranks), times ``2·cp`` under
    context parallelism (each sequence is cut into 2·cp chunks, each CP rank's two then split over TP), times the FP8 recipe's token multiple (16, or 32
    for MXFP8) under FP8, since each TP rank's shard of the tokens enters FP8 GEMMs on its own."""
    par = cfg.parallel
    multiple = par.tp if par.sequence_parallel else 1
    multiple *= 2 * par.cp if par.cp > 1 else 1  # context parallelism: 2·cp chunks per sequence (or slot)
    if cfg.precision.dtype == "fp8":
        multiple *= FP8_RECIPES[cfg.precision.fp8_recipe].token_multiple
    return multiple


def _layout_problems(cfg: RunConfig, world_size: int) -> list[str]:
    arch, par = cfg.model.arch, cfg.parallel
    problems = [
        *_head_problems(arch, par),
        *_moe_problems(arch, par),
        *_pipeline_problems(arch, par),
        *_routing_replay_problems(cfg),
        *_precision_problems(cfg),
        *_recompute_problems(cfg),
    ]
    if world_size % par.model_parallel_size:
        problems.append(
            f"world size {world_size} (launch.nodes × launch.procs_per_node) is not divisible by "
            f"parallel.tp × parallel.pp × parallel.cp = {par.tp}×{par.pp}×{par.cp}; change one of them"
        )
    elif arch.is_moe and (world_size // par.pp) % (par.ep * par.etp):
        problems.append(
            f"world size / pp = {world_size // par.pp} is not divisible by parallel.ep × parallel.etp = "
            f"{par.ep}×{par.etp}; experts cannot be laid out"
        )
    problems += _batch_problems(cfg, world_size)
    if par.sequence_parallel and par.tp == 1:
        problems.append("parallel.sequence_parallel needs parallel.tp > 1; set it to false or raise tp")
    return problems


def _precision_problems(cfg: RunConfig) -> list[str]:
    """Megatron keeps the bf16 edge layers per pipeline stage; at most a stage's layers each way."""
    precision, per_stage = cfg.precision, cfg.model.arch.num_hidden_layers // cfg.parallel.pp
    return [
        f"precision.{name}={value} exceeds the {per_stage} decoder layers of a pipeline stage"
        for name, value in (
            ("bf16_layers_at_start", precision.bf16_layers_at_start),
            ("bf16_layers_at_end", precision.bf16_layers_at_end),
        )
        if precision.dtype == "fp8" and value > per_stage
    ]


def _recompute_problems(cfg: RunConfig) -> list[str]:
    """A selective module the model does not have would be accepted and do nothing: refuse it."""
    pattern = cfg.model.arch.moe_layer_pattern()
    missing = {"moe": not any(pattern), "moe_act": not any(pattern), "mlp": all(pattern)}
    return [
        f"model.recompute_modules: {name} has nothing to recompute in this model "
        f"({'no MoE layers' if name != 'mlp' else 'no dense MLP layers'}); remove it"
        for name in cfg.model.selective_modules
        if missing.get(name)
    ]


def _routing_replay_problems(cfg: RunConfig) -> list[str]:
    """Routing replay needs MoE routers (the layout limits are checked where the model is built)."""
    replay = cfg.algorithm.routing_replay
    if replay != "none" and not any(cfg.model.arch.moe_layer_pattern()):
        return [
            f"algorithm.routing_replay={replay} needs an MoE model, and model.hf_config has no MoE layers; "
            "set algorithm.routing_replay: none"
        ]
    return []


def _batch_problems(cfg: RunConfig, world_size: int) -> list[str]:
    """Every optimizer step must split evenly into data-parallel ranks × micro-batches."""
    par = cfg.parallel
    if par.max_tokens_per_micro_batch is not None:
        return _packing_problems(cfg)  # packed micro-batches take any number of sequences
    if world_size % par.model_parallel_size:
        return []
    split = data_parallel_size(cfg, world_size) * par.micro_batches
    per_update = cfg.rollout.n_samples * cfg.trainer.prompts_per_step // cfg.trainer.mini_batches
    problems = []
    if cfg.trainer.steps and per_update % split:
        problems.append(
            f"each RL update has {per_update} sequences (rollout.n_samples × trainer.prompts_per_step / "
            f"trainer.mini_batches), not divisible by data-parallel size × parallel.micro_batches = {split}"
        )
    if cfg.sft.steps and cfg.sft.global_batch % split:
        problems.append(
            f"sft.global_batch={cfg.sft.global_batch} is not divisible by data-parallel size × "
            f"parallel.micro_batches = {split}"
        )
    return problems


def _packing_problems(cfg: RunConfig) -> list[str]:
    budget, longest = cfg.parallel.max_tokens_per_micro_batch, cfg.rollout.max_new_tokens
    assert budget is not None  # the caller's condition
    mt = cfg.rollout.multi_turn
    if cfg.trainer.steps and mt is not None and budget < mt.max_context_tokens - 1:
        return [
            f"parallel.max_tokens_per_micro_batch={budget} is smaller than an episode of "
            f"rollout.multi_turn.max_context_tokens={mt.max_context_tokens} tokens (less one) takes: raise it, or "
            "lower max_context_tokens"
        ]
    if cfg.trainer.steps and budget < longest:
        return [
            f"parallel.max_tokens_per_micro_batch={budget} is smaller than rollout.max_new_tokens={longest}: a "
            "full-length response would not fit one micro-batch; raise it to at least the longest prompt + "
            "rollout.max_new_tokens"
        ]
    return []


def _head_problems(arch: QwenArch, par: ParallelConfig) -> list[str]:
    problems = []
    for field, value in (
        ("num_attention_heads", arch.num_attention_heads),
        ("num_key_value_heads", arch.num_key_value_heads),
    ):
        if value % par.tp:
            choices = [d for d in _divisors(value)]
            problems.append(
                f"parallel.tp={par.tp} does not divide model {field}={value}; choose tp in {choices}"
            )
    if arch.vocab_size % par.tp:
        problems.append(
            f"parallel.tp={par.tp} does not divide model vocab_size={arch.vocab_size} "
            "(Megatron would pad the vocabulary and break exact conversion); choose another tp"
        )
    return problems


def _moe_problems(arch: QwenArch, par: ParallelConfig) -> list[str]:
    if not arch.is_moe:
        if par.ep > 1:
            return [
                f"parallel.ep={par.ep} but model type {arch.model_type} has no experts; set parallel.ep: 1"
            ]
        return []
    problems = []
    if arch.num_experts % par.ep:
        problems.append(
            f"model num_experts={arch.num_experts} is not divisible by parallel.ep={par.ep}; "
            f"choose ep in {_divisors(arch.num_experts)}"
        )
    if par.tp > 1 and not par.sequence_parallel:
        problems.append(
            f"MoE with parallel.tp={par.tp} needs sequence parallelism; set parallel.sequence_parallel: true"
        )
    if par.ep == 1 and par.etp != par.tp:
        # Without EP, Megatron treats expert weights as dense ones, replicated over the data-parallel group
        # only: with etp < tp their gradients would miss the other TP ranks' tokens.
        problems.append(
            f"parallel.etp={par.etp} differs from parallel.tp={par.tp} while parallel.ep=1; "
            "set etp equal to tp (or use ep > 1)"
        )
    return problems


def _pipeline_problems(arch: QwenArch, par: ParallelConfig) -> list[str]:
    problems = []
    if arch.num_hidden_layers % par.pp:
        problems.append(
            f"model num_hidden_layers={arch.num_hidden_layers} is not divisible by parallel.pp={par.pp}; "
            f"choose pp in {_divisors(arch.num_hidden_layers)}"
        )
    if par.pp > 1 and arch.tie_word_embeddings:
        problems.append("tied embeddings with parallel.pp > 1 are not supported; use pp=1 or untied weights")
    return problems


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
