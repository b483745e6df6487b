"""The ``model``, ``parallel``, ``precision`` and ``optimizer`` sections: the network the trainer builds, its
Megatron parallel layout, its numerics and its optimizer (read by ``sapo_megatron/megatron/``; the cross-checks
against the world size are :mod:`sapo_megatron.config.layout`'s)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from sapo_megatron.config_section import Section
from sapo_megatron.errors import ConfigError
from sapo_megatron.model.arch import QwenArch
from sapo_megatron.model.precision import FP8_RECIPES, Fp8RecipeName

RecomputeModule = Literal["core_attn", "mlp", "moe", "moe_act"]


class ModelConfig(Section):
    """Which network to build.

    ``hf_config`` is a path to an HF ``config.json`` (or a directory holding one), relative paths being
    resolved against the YAML file's folder, or the same fields inline as a mapping.
    """

    hf_config: str | dict[str, Any] | None = Field(
        default=None,
        description="an HF config.json, its folder, the fields inline, 'tiny' (the embedded demo's architecture, "
        "sized to the data) or 'tiny_vl' (the CPU VL demo's, its ids and sizes from a VL tokenizer folder and the "
        "data); with init: hf, default: init_path's",
    )
    init: Literal["random", "hf", "megatron"] = "random"
    init_path: str | None = None
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    moe_grouped_gemm: bool = False
    moe_aux_loss_coeff: float = Field(default=0.0, ge=0.0)
    init_std: float = Field(default=0.02, gt=0.0)
    recompute: Literal["none", "selective", "full"] = Field(
        default="none",
        description="activation recomputation (Megatron's recompute_granularity): full recomputes every decoder "
        "layer in the backward (keeps only each layer's input), selective the modules in recompute_modules",
    )
    recompute_modules: list[RecomputeModule] | None = Field(
        default=None,
        description="recompute: selective only; Megatron's module names (default [core_attn]): core_attn, mlp "
        "(dense MLP), moe (the whole MoE layer), moe_act (expert activation; needs moe_grouped_gemm)",
    )
    freeze_vision: bool = Field(
        default=False,
        description="vision-language models: the vision tower gets no gradients, no optimizer state and no "
        "weight sync (the rollout engine keeps the tower it loaded)",
    )
    _arch: QwenArch | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_init(self) -> ModelConfig:
        if self.init != "random" and not self.init_path:
            raise ValueError(f"model.init={self.init!r} needs model.init_path (a checkpoint directory)")
        if self.hf_config is None:
            if self.init != "hf":
                raise ValueError(
                    "model.hf_config is missing: give an HF config.json (or its folder, or the fields inline), or "
                    "model.init: hf with model.init_path (whose config.json is then used)"
                )
            self.hf_config = self.init_path  # an HF checkpoint folder holds its own config.json
        if self.recompute_modules is not None and self.recompute != "selective":
            raise ValueError(
                f"model.recompute_modules only applies to model.recompute=selective (recompute is {self.recompute})"
            )
        if "moe_act" in self.selective_modules and not self.moe_grouped_gemm:
            raise ValueError(
                "model.recompute_modules: moe_act needs model.moe_grouped_gemm: true (Megatron's rule)"
            )
        return self

    @property
    def selective_modules(self) -> list[str]:
        """The modules selective recomputation covers ([] unless recompute=selective)."""
        if self.recompute != "selective":
            return []
        return list(self.recompute_modules) if self.recompute_modules is not None else ["core_attn"]

    @property
    def arch(self) -> QwenArch:
        """The parsed architecture (read once)."""
        if self._arch is None:
            source = self.hf_config
            if source is None:
                raise ConfigError("model.hf_config is not set (an HF config.json, its folder, or a mapping)")
            self._arch = (
                QwenArch.from_hf_dict(source) if isinstance(source, dict) else QwenArch.from_path(source)
            )
        return self._arch


class ParallelConfig(Section):
    """Megatron parallel layout. Data parallelism is whatever the world size leaves over."""

    tp: int = Field(default=1, ge=1, description="tensor parallel size")
    pp: int = Field(default=1, ge=1, description="pipeline parallel size")
    ep: int = Field(default=1, ge=1, description="expert parallel size")
    etp: int = Field(
        default=1, ge=1, description="expert tensor parallel size (defaults to tp, as in Megatron)"
    )
    cp: int = Field(default=1, ge=1, description="context parallel size")
    sequence_parallel: bool = False
    micro_batches: int = Field(
        default=1, ge=1, description="micro-batches per optimizer step and rank (packed: at least this many)"
    )
    max_tokens_per_micro_batch: int | None = Field(
        default=None,
        ge=1,
        description="pack sequences into micro-batches of at most this many tokens (sapo_megatron/model/packing.py); "
        "null: one right-padded rectangle per micro-batch",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_etp_to_tp(cls, data: Any) -> Any:
        if isinstance(data, dict) and "etp" not in data:
            data = {**data, "etp": data.get("tp", 1)}
        return data

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp


class PrecisionConfig(Section):
    """Parameter / compute precision. fp8 keeps bf16 parameters (fp32 master weights in the optimizer) and runs the
    decoder layers' GEMMs in FP8 through a Transformer Engine recipe (docs/fp8.md): ``delayed`` (amax history),
    ``tensorwise`` (current per-tensor scaling), ``blockwise`` (1x128 / 128x128 tiles, Hopper) or ``mxfp8``
    (32-element MX blocks, Blackwell only). Validation needs no Transformer Engine; training does."""

    dtype: Literal["fp32", "bf16", "fp8"] = "fp32"
    fp8_recipe: Fp8RecipeName = "tensorwise"
    fp8_format: Literal["e4m3", "hybrid"] | None = Field(
        default=None,
        description="e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients); default: hybrid for delayed and "
        "tensorwise, e4m3 for blockwise and mxfp8",
    )
    fp8_amax_history_len: int | None = Field(
        default=None, ge=1, description="delayed scaling only: amax history window (default 1024, as TE)"
    )
    fp8_amax_compute_algo: Literal["max", "most_recent"] | None = Field(
        default=None,
        description="delayed scaling only: scale from the history's max or the latest amax (default max)",
    )
    bf16_layers_at_start: int = Field(
        default=0, ge=0, description="fp8: keep this many first decoder layers in bf16 (not with delayed)"
    )
    bf16_layers_at_end: int = Field(
        default=0, ge=0, description="fp8: keep this many last decoder layers in bf16 (not with delayed)"
    )
    fp8_param_gather: bool = Field(
        default=False,
        description="fp8: keep the decoder GEMM weights in FP8 and all-gather them in FP8 (needs "
        "optimizer.use_distributed_optimizer); halves those weights' memory and gather traffic",
    )

    @model_validator(mode="after")
    def _check_fp8(self) -> PrecisionConfig:
        given = [
            f
            for f in _FP8_ONLY_FIELDS
            if f in self.model_fields_set and getattr(self, f) not in (None, 0, False)
        ]
        if self.dtype != "fp8" and given:
            raise ValueError(
                f"precision.{given[0]} only applies to precision.dtype=fp8 (dtype is {self.dtype})"
            )
        recipe = FP8_RECIPES[self.fp8_recipe]
        amax = [f for f in ("fp8_amax_history_len", "fp8_amax_compute_algo") if getattr(self, f) is not None]
        if amax and not recipe.amax_history:
            raise ValueError(
                f"precision.{amax[0]} is a delayed-scaling setting; fp8_recipe={self.fp8_recipe} scales from the "
                "current tensor. Remove it or set fp8_recipe: delayed"
            )
        if (self.bf16_layers_at_start or self.bf16_layers_at_end) and not recipe.bf16_edge_layers:
            raise ValueError(
                "precision.bf16_layers_at_start/_end: Megatron cannot keep layers in bf16 under delayed scaling; "
                "use fp8_recipe tensorwise, blockwise or mxfp8"
            )
        return self

    @property
    def fp8_format_resolved(self) -> str:
        return self.fp8_format or FP8_RECIPES[self.fp8_recipe].default_format


_FP8_ONLY_FIELDS = (
    "fp8_format",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "bf16_layers_at_start",
    "bf16_layers_at_end",
    "fp8_param_gather",
)


class OptimizerConfig(Section):
    """Megatron optimizer (plain or distributed) and learning-rate schedule."""

    name: Literal["adam", "sgd"] = "adam"
    lr: float = Field(default=1e-6, gt=0.0)
    min_lr: float = Field(default=0.0, ge=0.0)
    weight_decay: float = Field(default=0.01, ge=0.0)
    adam_beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(default=0.98, ge=0.0, lt=1.0)
    adam_eps: float = Field(default=1e-8, gt=0.0)
    clip_grad: float = Field(default=1.0, ge=0.0, description="0 disables clipping")
    use_distributed_optimizer: bool = False
    warmup_steps: int = Field(default=0, ge=0)
    decay_style: Literal["constant", "linear", "cosine"] = "constant"
    decay_steps: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check_lrs(self) -> OptimizerConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"optimizer.min_lr={self.min_lr} exceeds optimizer.lr={self.lr}")
        if self.use_distributed_optimizer and self.name != "adam":
            raise ValueError(
                "optimizer.use_distributed_optimizer needs optimizer.name=adam (Megatron shards Adam only)"
            )
        return self
