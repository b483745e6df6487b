"""Build a Megatron-Core GPTModel equivalent to HF ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``.

Qwen3 in Megatron terms: RMSNorm (eps from the HF config), QK-norm (RMSNorm over head_dim), grouped-query
attention with an explicit ``kv_channels = head_dim``, RoPE with ``rotary_base = rope_theta``, no linear biases,
SwiGLU MLP (``gated_linear_unit`` + silu) or SwiGLU experts behind a softmax top-k router, where HF's
``norm_topk_prob=True`` (softmax over all experts, top-k, renormalise) equals Megatron's softmax *after* top-k,
and ``norm_topk_prob=False`` equals ``moe_router_pre_softmax``. The router runs in fp32 like HF's.

The layer spec is Transformer Engine's when TE imports (GPU clusters), else Megatron's local pure-torch spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from sapo_megatron.config import ConfigError, ModelConfig, ParallelConfig, PrecisionConfig
from sapo_megatron.megatron.context_parallel import with_context_parallel_attention
from sapo_megatron.model.arch import ArchError, QwenArch
from sapo_megatron.model.precision import FP8_RECIPES, fp8_runtime_problem, have_transformer_engine

PARAMS_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


@dataclass(frozen=True)
class BuildOptions:
    """What the model builder needs besides the architecture."""

    model: ModelConfig
    parallel: ParallelConfig
    precision: PrecisionConfig
    use_te: bool | None = None  # None: use TE when it imports
    routing_replay: bool = False


def transformer_config(opts: BuildOptions) -> TransformerConfig:
    """The Megatron ``TransformerConfig`` for an HF Qwen3 / Qwen3-MoE architecture and a parallel layout."""
    arch, par = opts.model.arch, opts.parallel
    dtype = PARAMS_DTYPE[opts.precision.dtype]
    return TransformerConfig(
        num_layers=arch.num_hidden_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=opts.model.init_std,
        attention_softmax_in_fp32=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        context_parallel_size=par.cp,
        # TE's CP attention on GPUs: p2p (ring, Megatron's default), which also takes THD packed rows (TE's
        # all_gather does not); the CPU stand-in all-gathers K/V (context_parallel.ContextParallelAttention).
        cp_comm_type="p2p" if par.cp > 1 else None,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp,
        sequence_parallel=par.sequence_parallel,
        variable_seq_lengths=False,  # every micro-batch of a step has one shape; see TrainEngine
        moe_token_dispatcher_type=opts.model.moe_token_dispatcher,
        **fp8_fields(opts.precision),
        **recompute_fields(opts.model),
        **_moe_fields(arch, opts),
    )


def fp8_fields(precision: PrecisionConfig) -> dict:
    """``TransformerConfig`` fields of the FP8 recipe ({} unless ``precision.dtype`` is fp8).

    The field names are the same in megatron-core 0.16.1 and 0.19.x (0.19 adds ``fp8_output_proj`` and FP4,
    unused here). Megatron enters ``fp8_autocast`` per decoder layer itself (``get_fp8_context``), skipping the
    bf16 edge layers, and builds the layers under ``fp8_model_init`` when ``fp8_param`` is set."""
    if precision.dtype != "fp8":
        return {}
    fields: dict = {"fp8": precision.fp8_format_resolved, "fp8_recipe": precision.fp8_recipe}
    if FP8_RECIPES[precision.fp8_recipe].amax_history:
        # Megatron's defaults (1, most_recent) differ from TE's DelayedScaling (1024, max); TE's are the tested ones.
        fields["fp8_amax_history_len"] = precision.fp8_amax_history_len or 1024
        fields["fp8_amax_compute_algo"] = precision.fp8_amax_compute_algo or "max"
    if precision.bf16_layers_at_start or precision.bf16_layers_at_end:
        fields["first_last_layers_bf16"] = True
        fields["num_layers_at_start_in_bf16"] = precision.bf16_layers_at_start
        fields["num_layers_at_end_in_bf16"] = precision.bf16_layers_at_end
    if precision.fp8_param_gather:
        fields["fp8_param"] = True
    return fields


def fp8_ddp_fields(precision: PrecisionConfig) -> dict:
    """``DistributedDataParallelConfig`` fields for FP8 weights gathered in FP8 (same names in 0.16.1 and 0.19.x).
    MXFP8 reuses the gradient buffer for the gathered weights, as Megatron recommends (it warns otherwise)."""
    if precision.dtype != "fp8" or not precision.fp8_param_gather:
        return {}
    return {
        "fp8_param_gather": True,
        "reuse_grad_buf_for_mxfp8_param_ag": precision.fp8_recipe == "mxfp8",
    }


def fp8_optimizer_fields(precision: PrecisionConfig) -> dict:
    """Megatron ``OptimizerConfig`` fields: the distributed optimizer handles FP8 weights per recipe."""
    if precision.dtype != "fp8":
        return {}
    fields: dict = {"fp8_recipe": precision.fp8_recipe}
    if precision.fp8_param_gather and precision.fp8_recipe == "mxfp8":
        fields["reuse_grad_buf_for_mxfp8_param_ag"] = True
    return fields


def recompute_fields(model: ModelConfig) -> dict:
    """``TransformerConfig`` fields of ``model.recompute``: full recomputes each decoder layer from its input
    (uniform method, one layer per checkpoint); selective checkpoints the named modules."""
    if model.recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if model.recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": model.selective_modules}
    return {}


def _moe_fields(arch: QwenArch, opts: BuildOptions) -> dict:
    if not arch.is_moe:
        return {}
    if arch.num_experts_per_tok == 1 and arch.norm_topk_prob:
        raise ArchError("top-1 routing with norm_topk_prob=true has no Megatron equivalent")
    pattern = arch.moe_layer_pattern()
    return {
        "num_moe_experts": arch.num_experts,
        "moe_router_topk": arch.num_experts_per_tok,
        "moe_ffn_hidden_size": arch.moe_intermediate_size,
        "moe_layer_freq": 1 if all(pattern) else pattern,
        "moe_router_pre_softmax": not arch.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if opts.model.moe_aux_loss_coeff > 0 else "none",
        "moe_aux_loss_coeff": opts.model.moe_aux_loss_coeff,
        "moe_grouped_gemm": opts.model.moe_grouped_gemm,
        "moe_enable_routing_replay": opts.routing_replay,
    }


def layer_spec(config: TransformerConfig, opts: BuildOptions) -> ModuleSpec:
    """Transformer Engine layer spec on GPU clusters, Megatron's local spec elsewhere."""
    use_te = have_transformer_engine() if opts.use_te is None else opts.use_te
    if config.fp8 and not use_te:
        raise ConfigError(
            "precision.dtype=fp8 needs the Transformer Engine layer spec; the local spec has no FP8"
        )
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        # cp > 1: TEDotProductAttention runs context parallelism itself (config.cp_comm_type).
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    spec = _local_spec(config, opts)
    if config.context_parallel_size > 1:
        if torch.cuda.is_available():
            raise ConfigError(
                "parallel.cp > 1 on GPUs needs Transformer Engine's attention; install transformer-engine "
                "or set parallel.cp: 1"
            )
        return with_context_parallel_attention(spec)  # the CPU stand-in for TE's CP attention
    return spec


def _local_spec(config: TransformerConfig, opts: BuildOptions) -> ModuleSpec:
    num_experts = config.num_moe_experts
    if opts.model.moe_grouped_gemm:
        raise ArchError("model.moe_grouped_gemm needs Transformer Engine; set it to false on this machine")
    if num_experts and not all(opts.model.arch.moe_layer_pattern()):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=True, normalization="RMSNorm")


def build_gpt_model(opts: BuildOptions, *, vp_stage: int | None = None) -> GPTModel:
    """One model chunk for this rank (pipeline stage decided by Megatron's parallel state). FP8 is refused here,
    before any weight exists, when Transformer Engine or a GPU that runs the recipe is missing."""
    if opts.precision.dtype == "fp8":
        problem = fp8_runtime_problem(opts.precision.fp8_recipe)
        if problem:
            raise ConfigError(problem)
    config = transformer_config(opts)
    model = build_model_chunk(
        opts,
        config,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
    )
    if config.bf16:
        # The pure-torch norms ignore params_dtype; cast them like Megatron's Float16Module does, but keep the
        # logits in bf16 (the chunked log-prob kernel upcasts per chunk, never the whole [tokens × vocab]).
        model.bfloat16()
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def build_model_chunk(
    opts: BuildOptions,
    config: TransformerConfig,
    *,
    pre_process: bool,
    post_process: bool,
    layout_only: bool = False,
) -> GPTModel:
    """The ``GPTModel`` of ``opts`` (a :class:`~sapo_megatron.megatron.vl_model.VLGPTModel` for a
    vision-language config) on the current device, before any dtype cast. ``layout_only``: a model whose
    parameter names and shapes are all that matters (the vision tower is then a plain holder of parameters)."""
    arch = opts.model.arch
    if opts.model.freeze_vision and not arch.is_vl:
        raise ConfigError(f"model.freeze_vision: the model ({arch.model_type}) has no vision tower")
    common = dict(
        config=config,
        transformer_layer_spec=layer_spec(config, opts),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        rotary_base=int(arch.rope_theta),
        parallel_output=True,
    )
    if arch.is_vl:
        from sapo_megatron.megatron.vl_model import VLGPTModel, check_vl_layout

        check_vl_layout(arch, pp=opts.parallel.pp, recompute=opts.model.recompute)
        return VLGPTModel(
            arch=arch, freeze_vision=opts.model.freeze_vision, layout_only=layout_only, **common
        )
    return GPTModel(position_embedding_type="rope", **common)
