"""Typed run configuration, loaded from YAML and validated once, before any process group or model exists.

Every error names the field and the fix. :func:`load_config` returns a :class:`RunConfig`;
:func:`validate_layout` checks the parallel layout against the model and the world size;
:meth:`RunConfig.save_resolved` writes the resolved config next to the run's outputs.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from sapo_megatron.algo import (
    AdvantageConfig,
    FusionConfig,
    MismatchCorrectionConfig,
    NoCorrection,
    PolicyLossConfig,
    RlFusion,
    SapoLoss,
)
from sapo_megatron.data.datasets import DatasetKeys
from sapo_megatron.distill.config import TeacherConfig, check_distillation
from sapo_megatron.errors import ConfigError  # ConfigError: also importable from here, as before
from sapo_megatron.eval.config import EvalConfig, materialised_eval, refuse_old_eval_keys
from sapo_megatron.model.arch import ArchError, QwenArch
from sapo_megatron.model.precision import (
    FP8_RECIPES,
    GPU_TYPES,
    Fp8RecipeName,
    GpuTypeName,
    fp8_capability_problem,
)
from sapo_megatron.runtime.wandb_tracking import TrackingConfig

_logger = logging.getLogger(__name__)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated, inf / nan refused."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


RecomputeModule = Literal["core_attn", "mlp", "moe", "moe_act"]


class ModelConfig(Section):
    """Which network to build.

    ``hf_config`` is a path to an HF ``config.json`` (or a directory holding one), relative paths being
    resolved against the YAML file's folder, or the same fields inline as a mapping.
    """

    hf_config: str | dict[str, Any] | None = Field(
        default=None,
        description="an HF config.json, its folder, the fields inline, or 'tiny' (the embedded demo's architecture, "
        "sized to the data); with init: hf, default: init_path's",
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


class LaunchConfig(Section):
    """How many processes the job runs on: nodes × processes per node (one per GPU on clusters)."""

    nodes: int = Field(default=1, ge=1)
    procs_per_node: int = Field(default=1, ge=1)
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch threads per process on CPU machines (tiny models: 1 is fastest)",
    )
    timeout_minutes: int = Field(
        default=60,
        ge=1,
        description="process-group timeout: how long ranks wait in a collective (e.g. while rank 0 rolls out)",
    )
    gpu_type: GpuTypeName | None = Field(
        default=None,
        description="the GPU model of the job (h100, h200, b200, ...): refuses FP8 recipes it cannot run (mxfp8 "
        "on Hopper) and gives the planner its memory; training also checks the GPU it finds",
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class SFTConfig(Section):
    """Supervised training on prompt/response pairs (the warm start before RL; also a standalone job)."""

    steps: int = Field(default=0, ge=0)
    global_batch: int = Field(default=32, ge=1, description="sequences per optimizer step, all ranks")
    lr: float | None = Field(default=None, gt=0.0, description="overrides optimizer.lr during SFT")
    log_every: int = Field(default=10, ge=1)
    save_every: int = Field(
        default=0,
        ge=0,
        description="checkpoint every N SFT steps (0: at the end of SFT, or when interrupted)",
    )


class ColocateConfig(Section):
    """The colocated step (sapo_megatron/loop/colocation.py, docs/cluster.md "Colocated training"): the engine releases
    its memory while the trainer trains, then takes it back and receives the new weights."""

    offload_trainer: bool = Field(
        default=True,
        description="move the trainer's parameters, gradients and optimizer state off the device while the engine "
        "generates (in place; the training is bitwise the same)",
    )
    bucket_mb: int = Field(
        default=512,
        ge=1,
        le=65536,
        description="tensor sync bucket size in MiB (the planner counts one bucket on top of the rollout phase)",
    )
    check_weights: bool = Field(
        default=False,
        description="after each sync compare SGLang's /weights_checker checksums with the trainer's export "
        "(TP-1 servers, weight_sync: tensor, rollout.precision fp32 or bf16; checksums match on CPU servers)",
    )


class MultiTurnConfig(Section):
    """``rollout.multi_turn``: each sample is an episode of engine turns and tool observations on one token
    sequence (docs/multi_turn.md). Needs a chat template (``data.apply_chat_template: true``)."""

    python_tool: bool = Field(
        default=True, description="offer the built-in sandboxed Python tool (name: python, argument: code)"
    )
    python_timeout_s: float = Field(
        default=10.0, gt=0.0, le=3600.0, description="the Python tool's wall time"
    )
    python_memory_mb: int = Field(default=1024, ge=64, description="the Python tool's address-space limit")
    tools_file: str | None = Field(
        default=None, description="YAML of user tools: import path + OpenAI function schema (+ config)"
    )
    episode_function: str | None = Field(
        default=None,
        description="import path of an async episode function (ctx, ledger) -> EpisodeInfo, replacing the "
        "built-in tool loop",
    )
    max_turns: int = Field(default=8, ge=1, description="engine turns per episode")
    max_tool_calls: int = Field(default=16, ge=0, description="tool calls per episode")
    max_context_tokens: int = Field(
        default=4096,
        ge=2,
        description="prompt + every turn and observation; turns are clamped to what is left",
    )
    max_tool_output_chars: int = Field(default=2048, ge=16, description="longer observations are cut")
    tool_timeout_s: float = Field(
        default=30.0, gt=0.0, description="per tool call; a timeout is the observation"
    )
    max_concurrent_tools: int = Field(
        default=32, ge=1, description="tool calls running at once, all episodes"
    )
    end_of_turn: str | None = Field(
        default=None,
        description="the token a turn ends with (default: the tokenizer's eos, Qwen: <|im_end|>)",
    )
    parallel_engine_calls: int | None = Field(
        default=None,
        ge=1,
        description="engine calls in flight (default: 1 for the in-process CPU engine, which batches the ready "
        "turns into one forward; rollout.concurrency for servers)",
    )


class RolloutConfig(Section):
    """Where samples come from: the CPU engine (in-process, or behind its SGLang-compatible HTTP server) or
    SGLang servers (workers), optionally behind an ``sglang-router`` that balances ``/generate``.

    Topology (engine: sglang): ``urls`` lists the workers; ``router_url`` is used for ``/generate`` only; weight
    sync, ``/flush_cache``, health and model info go to every worker. With only ``router_url``, the workers are
    read from the router (``GET /workers``). ``endpoints_file`` is the JSON that ``launch/slurm_rollout.sbatch``
    writes (``{"router_url": ..., "workers": [...]}``); the trainer waits for it and for healthy servers.
    """

    engine: Literal["cpu", "sglang"] = "cpu"
    urls: list[str] = Field(default_factory=list, description="SGLang worker URLs (engine: sglang)")
    router_url: str | None = Field(default=None, description="sglang-router URL, used for /generate only")
    endpoints_file: str | None = Field(
        default=None,
        description="JSON with router_url and workers written by the rollout job; waited for at start",
    )
    api_key_env: str = Field(
        default="SAPO_ROLLOUT_API_KEY",
        description="environment variable holding the servers' API key (sent as a Bearer token when set)",
    )
    startup_timeout_s: float = Field(
        default=900.0, gt=0.0, description="how long to wait for the endpoints file and healthy servers"
    )
    routed_experts: bool = Field(
        default=False,
        description="request each sample's routed experts (MoE routing metrics and replay need them)",
    )
    precision: Literal["fp32", "bf16", "fp8"] = Field(
        default="fp32",
        description="the rollout engine's numerics. CPU engine: fp32 (equals the trainer), bf16 (weights and "
        "activations), or fp8 (SGLang's block-wise W8A8 fp8: 128x128 e4m3 weight blocks and per-token-group "
        "activations on the decoder's linear layers, bf16 elsewhere). SGLang servers run what they were launched "
        "with (launch/slurm_rollout.sbatch: SAPO_QUANTIZATION=fp8); set this to match them, the trainer cannot "
        "change a remote server's precision",
    )
    colocated: bool = Field(
        default=False,
        description="the SGLang servers share the trainer's GPUs (needed for weight_sync: tensor with sglang)",
    )
    cpu_http: bool = Field(
        default=False, description="run the CPU engine behind its HTTP server and use the client"
    )
    colocate: ColocateConfig | None = Field(
        default=None,
        description="time-share the devices with the engine: release it while training, offload the trainer "
        "while generating (engine: sglang with colocated: true, or the CPU engine with cpu_http: true)",
    )
    n_samples: int = Field(default=8, ge=1, le=4096, description="responses per prompt (the GRPO group size)")
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    max_new_tokens: int = Field(default=512, ge=1, le=10_000_000)
    weight_sync: Literal["tensor", "disk", "distributed"] | None = Field(
        default=None,
        description="tensor (colocated engines), disk (shared filesystem) or distributed (NCCL/gloo broadcast); "
        "default: tensor for the CPU engine, distributed for SGLang",
    )
    weight_sync_dir: str | None = Field(
        default=None,
        description="disk sync: a directory on a filesystem every server can read (default: "
        "<output_dir>/rollout_weights, made absolute)",
    )
    timeout_s: float = Field(default=600.0, gt=0.0)
    weight_sync_timeout_s: float = Field(
        default=1800.0,
        gt=0.0,
        le=86400.0,
        description="how long one weight-sync call (an HTTP reply, a group's forming, a bucket's broadcast) may "
        "take before the run fails; a stop signal interrupts it at once",
    )
    max_retries: int = Field(default=3, ge=0)
    concurrency: int = Field(default=64, ge=1, le=100_000)
    threads: int | None = Field(default=None, ge=1, description="torch threads of the CPU engine")
    multi_turn: MultiTurnConfig | None = Field(
        default=None, description="multi-turn episodes with tools (None: one response per sample)"
    )

    @model_validator(mode="after")
    def _check_engine(self) -> RolloutConfig:
        given = [name for name in ("urls", "router_url", "endpoints_file") if getattr(self, name)]
        if self.engine == "sglang" and not given:
            raise ValueError(
                "rollout.engine=sglang needs rollout.urls (worker URLs), rollout.router_url or "
                "rollout.endpoints_file (written by launch/slurm_rollout.sbatch)"
            )
        if self.engine == "cpu" and given:
            raise ValueError(
                f"rollout.{given[0]} is only used with rollout.engine=sglang; remove it or change the engine"
            )
        if self.endpoints_file and (self.urls or self.router_url):
            raise ValueError(
                "rollout.endpoints_file already names the router and the workers; drop rollout.urls / "
                "rollout.router_url, or drop endpoints_file"
            )
        if self.weight_sync is None:
            self.weight_sync = "tensor" if self.engine == "cpu" else "distributed"
        if self.weight_sync == "tensor" and self.engine == "sglang" and not self.colocated:
            raise ValueError(
                "rollout.weight_sync=tensor hands tensors to the servers by CUDA IPC, which works only when they "
                "run on the trainer's GPUs; use weight_sync: distributed (broadcast to remote servers) or disk "
                "(shared filesystem), or set rollout.colocated: true if the servers are colocated"
            )
        if self.colocate is not None:
            self._check_colocate(self.colocate)
        if self.weight_sync == "distributed" and self.engine == "cpu":
            raise ValueError(
                "rollout.weight_sync=distributed broadcasts to servers in other processes (engine: sglang, e.g. "
                "CPU servers started with `sapo-megatron serve`); the CPU engine in the trainer's process takes "
                "weight_sync: tensor or disk"
            )
        return self

    def _check_colocate(self, colocate: ColocateConfig) -> None:
        if self.engine == "sglang" and not self.colocated:
            raise ValueError(
                "rollout.colocate time-shares the trainer's GPUs with the servers; set rollout.colocated: true "
                "(servers on the trainer's GPUs) or drop rollout.colocate"
            )
        if self.engine == "cpu" and not self.cpu_http:
            raise ValueError(
                "rollout.colocate releases and resumes the engine over SGLang's HTTP API; the in-process CPU "
                "engine has none: set rollout.cpu_http: true"
            )
        if colocate.check_weights and self.weight_sync != "tensor":
            raise ValueError(
                "rollout.colocate.check_weights hashes the tensor sync's buckets; it needs weight_sync: tensor"
            )
        if colocate.check_weights and self.precision == "fp8":
            raise ValueError(
                "rollout.colocate.check_weights compares exact bytes; an fp8 server holds requantized weights: "
                "turn it off for rollout.precision fp8"
            )


class DataConfig(DatasetKeys):
    """Prompt data: jsonl / parquet files (a directory or glob of shards; verl, slime or own keys, see
    docs/data.md), or the built-in synthetic addition task (``synthetic:addition``); how prompts become ids."""

    train: str = "synthetic:addition"
    tokenizer: str = Field(
        default="char",
        description="'char' (the demo's characters), 'chat' (the shipped byte-level BPE with a Qwen-style chat "
        "template), 'qwen3' (the real Qwen3 tokenizer and template, `make qwen3-tokenizer`; apply_chat_template "
        "defaults to true with both) or an HF tokenizer directory",
    )
    digits: int = Field(default=2, ge=1, description="operand digits of the synthetic task")
    train_size: int = Field(default=4000, ge=1, description="synthetic training prompts")

    @model_validator(mode="before")
    @classmethod
    def _chat_tokenizer_renders_chat(cls, data: Any) -> Any:
        """``tokenizer: chat`` / ``qwen3`` exist to read message datasets: the template is on unless set off."""
        chat = isinstance(data, dict) and data.get("tokenizer") in ("chat", "qwen3")
        if chat and "apply_chat_template" not in data:
            return {**data, "apply_chat_template": True}
        return data

    @model_validator(mode="after")
    def _check_chat_tokenizer(self) -> DataConfig:
        if self.apply_chat_template and self.tokenizer == "char":
            raise ValueError(
                "data.apply_chat_template needs an HF tokenizer with a chat template; the char tokenizer has none "
                "(set data.tokenizer to the model's tokenizer directory, or to 'chat' for the tiny models)"
            )
        return self


class RemoteRewardConfig(Section):
    """``algorithm.reward: {url: ...}``: a reward server (protocol in docs/rewards.md)."""

    url: str = Field(description="http(s) URL the batches are POSTed to")
    api_key_env: str | None = Field(default=None, description="environment variable holding the bearer token")
    timeout_s: float = Field(default=60.0, gt=0, description="per request")
    max_retries: int = Field(
        default=3, ge=0, description="retries of 429 / 5xx / connection errors / timeouts"
    )
    batch_size: int = Field(default=256, ge=1, description="samples per request")


class WeightedReward(Section):
    """One entry of a list of rewards: ``algorithm.reward: [{reward: SPEC, weight: W}, ...]`` scores the weighted
    sum (TRL's ``reward_funcs`` + ``reward_weights``)."""

    reward: str | RemoteRewardConfig = Field(description="a registered name, an import path or {url: ...}")
    weight: float = Field(default=1.0, description="its weight in the sum")
    name: str | None = Field(
        default=None, description="its metric name (reward/<name>/mean); default: the function's name"
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="extra keyword arguments for it")


class AlgorithmConfig(Section):
    """The RL objective: policy loss (with its own settings), mismatch correction, advantages, sampling rules."""

    loss: PolicyLossConfig = Field(default_factory=SapoLoss)
    correction: MismatchCorrectionConfig = Field(default_factory=NoCorrection)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    reward: str | RemoteRewardConfig | list[str | WeightedReward] = Field(
        default="numeric_match",
        description="a registered reward name, an import path 'file.py:fn' / 'pkg.mod:fn', {url: ...} for a "
        "reward server, or a list of them ({reward: ..., weight: ...} each: the weighted sum, with per-function "
        "metrics; see docs/rewards.md)",
    )
    reward_workers: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        default="auto",
        description="reward worker processes: 0 inline, N a pool; reward_timeout_s per call either way; "
        "auto: inline for exact_match / numeric_match / dapo_math, else a pool",
    )
    reward_timeout_s: float = Field(
        default=30.0, gt=0, description="per reward call (inline: on the main thread)"
    )
    reward_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra keyword arguments for the reward, e.g. {mode: fraction}"
    )
    reward_after_thinking: bool | None = Field(
        default=None,
        description="the reward sees only the text after a response's </think> (a response cut while thinking: "
        "''); default: on for data.tokenizer qwen3 unless data.chat_template_kwargs.enable_thinking is false",
    )
    dynamic_sampling: bool = Field(default=False, description="DAPO: drop all-equal groups and refill")
    mask_truncated_completions: bool = Field(
        default=False,
        description="responses cut by max_new_tokens count in their group's reward statistics but are not "
        "trained on (TRL's mask_truncated_completions: loss mask 0)",
    )
    max_refills: int = Field(default=3, ge=0, description="extra rollout rounds to refill dropped groups")
    over_sampling: float = Field(
        default=1.0,
        ge=1.0,
        le=8.0,
        description="draw this many times the prompts a round needs (rounded up) and keep the first groups that "
        "pass, in data order: fewer refill rounds under dynamic sampling, aborts and failed episodes",
    )
    overlong_cache_len: int | None = Field(
        default=None,
        ge=1,
        description="DAPO soft overlong penalty window (uses rollout.max_new_tokens as L_max)",
    )
    routing_replay: Literal["none", "r2", "r3"] = Field(
        default="none",
        description="MoE routing replay: r2 replays the trainer's own routes of the old-log-prob pass, r3 the "
        "rollout engine's routes (needs rollout.routed_experts)",
    )
    max_reward_error_frac: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description="stop the run when more than this fraction of a step's rewards raised (they score 0)",
    )
    fusion: FusionConfig = Field(
        default_factory=RlFusion,
        description="how teacher advantages (on-policy distillation) meet the RL advantage: rl, opd, fixed, "
        "saf or mopd (see docs/distillation.md); all but rl need a teachers section",
    )
    opd_student_logp: Literal["trainer", "engine"] = Field(
        default="trainer",
        description="the student log-prob of A_opd = teacher_logp - student_logp: the trainer's old-policy "
        "log-prob (the default) or the rollout engine's",
    )

    @model_validator(mode="after")
    def _check_reward_list(self) -> AlgorithmConfig:
        if isinstance(self.reward, list) and not self.reward:
            raise ValueError("algorithm.reward is an empty list: give one reward or a list of them")
        if isinstance(self.reward, list) and self.reward_kwargs:
            raise ValueError(
                "algorithm.reward_kwargs with a list of rewards: give each entry its own, "
                "[{reward: ..., weight: ..., kwargs: {...}}]"
            )
        return self


MAX_SEQUENCES_PER_STEP = 10_000_000  # far above any real batch; an absurd size fails here, not out of memory


class TrainerConfig(Section):
    """The RL loop: steps, batch sizes and checkpoint cadence (evaluation: the ``eval`` section)."""

    steps: int = Field(default=20, ge=0, le=100_000_000)
    prompts_per_step: int = Field(default=16, ge=1, le=1_000_000)
    mini_batches: int = Field(default=1, ge=1, description="optimizer updates per rollout batch")
    save_every: int = Field(
        default=0, ge=0, description="checkpoint every N steps (0: only at the end, or when interrupted)"
    )
    max_bad_steps: int = Field(
        default=3,
        ge=1,
        description="stop after this many optimizer steps in a row with a non-finite loss or gradient norm",
    )
    keep_checkpoints: int = Field(default=2, ge=1)
    async_rollout: bool = Field(
        default=False,
        description="generate batch n+1 while training on batch n (one step off-policy; weights sync at step "
        "boundaries, rollout/staleness 1); see docs/rl_loop.md",
    )
    export_hf: bool = Field(default=True, description="write an HF checkpoint at the end")
    log_ref_kl: bool = Field(
        default=False,
        description="log kl/k3_ref, the k3 from the policy as RL starts, also when algorithm.loss.kl_coef is 0 "
        "(one more forward pass per step, and a frozen copy of the model)",
    )
    log_samples_every: int = Field(
        default=10, ge=0, description="write a few samples to samples.jsonl every N RL steps (0: never)"
    )


class RunConfig(Section):
    """A whole run. ``name`` and ``output_dir`` decide where everything is written."""

    name: str = "run"
    output_dir: str = "runs/run"
    seed: int = 1234
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    launch: LaunchConfig = LaunchConfig()
    sft: SFTConfig = SFTConfig()
    rollout: RolloutConfig = RolloutConfig()
    data: DataConfig = DataConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="evaluation datasets (docs/evaluation.md)"
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="W&B besides TensorBoard (docs/evaluation.md)"
    )
    teachers: list[TeacherConfig] = Field(
        default_factory=list, description="teachers that score the student's samples (distillation)"
    )

    @model_validator(mode="after")
    def _check_rl(self) -> RunConfig:
        loss = self.algorithm.loss
        if loss.agg == "seq-mean-token-sum-norm" and loss.max_len is None:
            raise ValueError("algorithm.loss.agg=seq-mean-token-sum-norm needs algorithm.loss.max_len")
        if self.algorithm.routing_replay == "r3" and not self.rollout.routed_experts:
            raise ValueError(
                "algorithm.routing_replay=r3 replays the rollout engine's routes, which it only returns when "
                "asked: set rollout.routed_experts: true (SGLang servers also need --enable-return-routed-experts)"
            )
        self._check_fp8_setup()
        check_distillation(
            self.teachers,
            self.algorithm.fusion,
            self.algorithm.loss,
            self.algorithm.correction.name,
            student_logp=self.algorithm.opd_student_logp,
            temperature=self.rollout.temperature,
        )
        if self.trainer.async_rollout and (self.rollout.colocated or self.rollout.colocate is not None):
            raise ValueError(
                "trainer.async_rollout overlaps generation with training, which needs servers on their own "
                "GPUs; set rollout.colocated: false (servers on other GPUs) or trainer.async_rollout: false"
            )
        if self.rollout.multi_turn is not None and not self.data.apply_chat_template:
            raise ValueError(
                "rollout.multi_turn renders tool observations with the model's chat template: set "
                "data.apply_chat_template: true (with an HF tokenizer that has one)"
            )
        mt, context = self.rollout.multi_turn, self.model.arch.max_position_embeddings
        if mt is not None and "max_context_tokens" in mt.model_fields_set and mt.max_context_tokens > context:
            raise ValueError(
                f"rollout.multi_turn.max_context_tokens={mt.max_context_tokens} is above the model's context "
                f"(model max_position_embeddings={context}): episodes would fail in the engine; lower it, or "
                "raise the model's context (with max_position_embeddings: auto it follows max_context_tokens)"
            )
        batch = self.rollout.n_samples * self.trainer.prompts_per_step
        if batch > MAX_SEQUENCES_PER_STEP:
            raise ValueError(
                f"trainer.prompts_per_step × rollout.n_samples = {batch} sequences per step is above the limit "
                f"of {MAX_SEQUENCES_PER_STEP}: lower trainer.prompts_per_step or rollout.n_samples"
            )
        if batch % self.trainer.mini_batches:
            raise ValueError(
                f"trainer.prompts_per_step × rollout.n_samples = {batch} sequences do not split into "
                f"trainer.mini_batches={self.trainer.mini_batches} equal updates"
            )
        return self

    def _check_fp8_setup(self) -> None:
        precision = self.precision
        if precision.fp8_param_gather and not self.optimizer.use_distributed_optimizer:
            raise ValueError(
                "precision.fp8_param_gather all-gathers FP8 weights from the distributed optimizer's shards: set "
                "optimizer.use_distributed_optimizer: true (Megatron's rule)"
            )
        gpu = GPU_TYPES.get(self.launch.gpu_type or "")
        if precision.dtype == "fp8" and gpu is not None:
            problem = fp8_capability_problem(
                precision.fp8_recipe, gpu.capability, f"launch.gpu_type={gpu.name}"
            )
            if problem:
                raise ValueError(problem)

    def resolved_dict(self) -> dict[str, Any]:
        """The resolved config as plain data (HF architecture inlined): what :meth:`save_resolved` writes."""
        data = self.model_dump(mode="json")
        data["model"]["hf_config"] = self.model.arch.to_hf_dict()
        data["eval"] = materialised_eval(self.eval)
        return data

    def save_resolved(self, path: str | Path) -> Path:
        """Write the resolved config (HF architecture inlined) as YAML; returns the path written."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(yaml.safe_dump(self.resolved_dict(), sort_keys=False))
        tmp.replace(path)
        return path


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    world_size: int | None = None,
    check_layout: bool = True,
) -> RunConfig:
    """Load, resolve and validate a YAML run config (or the embedded default when ``path`` is None). The layout
    is checked against ``world_size`` when given (dry run, planner), else against ``launch.*``; not at all with
    ``check_layout=False`` (the planner's layout search replaces it)."""
    if path is None:
        from sapo_megatron.defaults import embedded_default_dict

        raw, base_dir = embedded_default_dict(), Path.cwd()
    else:
        raw, base_dir = _read_yaml(Path(path)), Path(path).resolve().parent
    for dotted, value in (overrides or {}).items():
        _set_dotted(raw, dotted, value)
    _resolve_relative_hf_config(raw, base_dir)
    return config_from_dict(raw, world_size=world_size, check_layout=check_layout)


def config_from_dict(
    raw: dict[str, Any], *, world_size: int | None = None, check_layout: bool = True
) -> RunConfig:
    """Validate a config mapping; raise :class:`ConfigError` with one readable line per problem. The layout is
    checked against ``world_size`` when given, else against ``launch.nodes × launch.procs_per_node``."""
    refuse_old_eval_keys(raw)
    try:
        raw = fill_auto_sizes(raw)
        cfg = RunConfig.model_validate(raw)
        cfg.model.arch  # noqa: B018 - parse the HF config now, not after process groups exist
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None
    except ArchError as err:
        raise ConfigError(f"model.hf_config: {err}") from None
    if check_layout:
        validate_layout(cfg, world_size or cfg.launch.world_size)
    return cfg


TINY = "tiny"
"""``model.hf_config: tiny``: the embedded demo's architecture with its sizes following the data."""


def fill_auto_sizes(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with ``model.hf_config: tiny`` expanded and the ``"auto"`` sizes of an inline ``model.hf_config``
    taken from the tokenizer and the prompts (:mod:`sapo_megatron.data.sizing`); unchanged without any."""
    from sapo_megatron.data.sizing import (
        CONTEXT_FIELD,
        auto_fields,
        context_size,
        measured_context,
        token_sizes,
    )
    from sapo_megatron.data.tokenizer import load_tokenizer
    from sapo_megatron.data.tool_schemas import prompt_tool_schemas
    from sapo_megatron.eval.config import resolve_datasets

    model: dict[str, Any] = raw["model"] if isinstance(raw.get("model"), dict) else {}
    if model.get("hf_config") == TINY:
        from sapo_megatron.defaults import tiny_model

        model = {**model, "hf_config": tiny_model()}
        raw = {**raw, "model": model}
    fields = auto_fields(model.get("hf_config"))
    if not fields:
        return raw
    data: dict[str, Any] = raw["data"] if isinstance(raw.get("data"), dict) else {}
    tokenizer = load_tokenizer(str(data.get("tokenizer", "char")))
    hf = {**model["hf_config"], **token_sizes(tokenizer, fields)}
    hf = {key: value for key, value in hf.items() if value is not None}
    if CONTEXT_FIELD in fields:
        hf[CONTEXT_FIELD] = 1 << 20  # provisional: the prompts are measured with the validated settings
        cfg = RunConfig.model_validate({**raw, "model": {**model, "hf_config": hf}})
        sources: list[tuple[str, Any, int | None, int]] = [
            (cfg.data.train, cfg.data, cfg.data.train_size, cfg.rollout.max_new_tokens)
        ]
        sources += [(d.path, d.keys, d.size, d.max_new_tokens) for d in resolve_datasets(cfg)]
        mt = cfg.rollout.multi_turn
        measured = measured_context(
            sources, tokenizer, digits=cfg.data.digits, seed=cfg.seed, tools=prompt_tool_schemas(mt)
        )
        episode = (
            mt.max_context_tokens if mt is not None and "max_context_tokens" in mt.model_fields_set else 0
        )
        hf[CONTEXT_FIELD] = max(measured, context_size(episode, 0))  # an episode set to grow longer fits
    return {**raw, "model": {**model, "hf_config": hf}}


def validate_layout(cfg: RunConfig, world_size: int) -> None:
    """Check the parallel layout against the model and the world size; raise :class:`ConfigError`."""
    problems = _layout_problems(cfg, world_size)
    if problems:
        raise ConfigError("invalid parallel layout:\n" + "\n".join(f"  - {p}" for p in problems))


def data_parallel_size(cfg: RunConfig, world_size: int) -> int:
    return world_size // cfg.parallel.model_parallel_size


def sequence_length_multiple(cfg: RunConfig) -> int:
    """What every micro-batch's padded sequence length must be a multiple of: the tensor-parallel size under
    sequence parallelism (the sequence is split over TP ranks), times the FP8 recipe's token multiple (16, or 32
    for MXFP8) under FP8, since each TP rank's shard of the tokens enters FP8 GEMMs on its own."""
    par = cfg.parallel
    multiple = par.tp if par.sequence_parallel else 1
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
    if par.cp > 1:
        # The policy-loss hook needs each sequence whole on one rank (sequence-level ratios and normalisers).
        problems.append("parallel.cp > 1 (context parallelism) is not supported yet; set parallel.cp: 1")
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
    mt = cfg.rollout.multi_turn
    if budget is None:  # not packed: nothing to check
        return []
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


def _read_yaml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(
            f"config file {path} is a directory: give the YAML file in it (e.g. {path}/run.yaml)"
        )
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file {path} is {path.stat().st_size} bytes; a run config is a few kB (the limit is "
            f"{MAX_CONFIG_BYTES})"
        )
    try:
        raw = parse_yaml(path.read_text(encoding="utf-8"), str(path))
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {err.start}: {err.object[err.start : err.start + 4]!r}): save it as "
            "UTF-8"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path} must hold a mapping of sections (model, parallel, ...), got {type(raw).__name__}"
        )
    return raw


MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_ALIASES = 100
MAX_YAML_DEPTH = 32
MAX_YAML_VALUES = 100_000
"""Limits of a config's YAML (a run config is a few kB, a handful of anchors, about 5 levels deep): an alias
bomb ("billion laughs"), a huge file or a deeply nested one stops with one line instead of eating memory."""


def parse_yaml(text: str, where: str, *, yaml_errors: bool = False) -> Any:
    """Safe-load ``text`` (a config file, or a ``--set`` value) within the limits above; keys given twice in one
    mapping and values Python cannot hold (a 5000-digit integer) are refused naming ``where``."""
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as err:
        raise ConfigError(f"{where}: {err}") from None
    except yaml.YAMLError as err:
        if yaml_errors:  # the caller words it (--set: the problem and its column)
            raise
        raise ConfigError(f"{where} is not valid YAML: {_one_line_yaml_error(err)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply (the limit is {MAX_YAML_DEPTH} levels)") from None
    except ValueError as err:  # int() of a number with more digits than Python converts
        raise ConfigError(
            f"{where}: a value YAML cannot convert ({' '.join(str(err).split())[:200]})"
        ) from None
    _check_size(value, where)
    return value


def _one_line_yaml_error(err: yaml.YAMLError) -> str:
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    return f"{context + ': ' if context else ''}{problem}{where}"


def _check_size(value: Any, where: str) -> None:
    """Walk the loaded value as the validation will (aliases expanded), stopping at the limits."""
    budget = [MAX_YAML_VALUES]
    stack = [(value, 0)]
    while stack:
        item, level = stack.pop()
        budget[0] -= 1
        if budget[0] < 0:
            raise ConfigError(
                f"{where}: expands to more than {MAX_YAML_VALUES} values (aliases repeated inside aliases: an "
                "alias bomb?)"
            )
        if level > MAX_YAML_DEPTH:
            raise ConfigError(f"{where}: nested too deeply (the limit is {MAX_YAML_DEPTH} levels)")
        if isinstance(item, dict):
            stack.extend((child, level + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, level + 1) for child in item)


class _DuplicateKey(yaml.YAMLError):
    """A mapping key given twice; the message names both lines."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(
                    f"more than {MAX_YAML_ALIASES} aliases (*name) at line {mark.line + 1}: an alias bomb? "
                    "a run config needs a few"
                )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base' merges keys; the base may repeat them
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(
                    f"key {key!r} appears twice (lines {seen[key]} and {line}); the second would replace the "
                    "first: merge them"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _resolve_relative_hf_config(raw: dict[str, Any], base_dir: Path) -> None:
    model = raw.get("model")
    if not isinstance(model, dict):
        return
    for key in ("hf_config", "init_path"):
        value = model.get(key)
        if (
            isinstance(value, str)
            and not Path(value).is_absolute()
            and not (key == "hf_config" and value == TINY)
        ):
            model[key] = str((base_dir / value).resolve())


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Apply one ``--set`` override. Setting the ``name`` of a section with variants (``algorithm.loss``,
    ``algorithm.correction``) switches the variant: keys the new one does not accept (e.g. SAPO's ``tau_pos``
    when switching to ``grpo``) are dropped, the shared ones (``kl_coef``, ``agg``, ...) are kept."""
    node = raw
    *parents, leaf = dotted.split(".")
    for depth, key in enumerate(parents):
        if isinstance(node, list):  # eval.datasets.0.size
            node = node[_list_index(node, key, dotted, parents[:depth])]
            continue
        node = node.setdefault(key, {}) if isinstance(node, dict) else None
        if not isinstance(node, dict | list):
            raise ConfigError(f"override {dotted}: {key} is not a section")
    if isinstance(node, list):
        node[_list_index(node, leaf, dotted, parents)] = value
        return
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        _merge_section(node[leaf], value, (*parents, leaf))
        return
    if leaf == "name" and isinstance(value, str):
        _drop_keys_of_other_variant(node, tuple(parents), value)
    node[leaf] = value


def _list_index(node: list[Any], key: str, dotted: str, parents: list[str]) -> int:
    if key.isdigit() and int(key) < len(node):
        return int(key)
    where = ".".join(parents) or "the value"
    valid = f"0 to {len(node) - 1}" if node else "none: the list is empty"
    raise ConfigError(
        f"override {dotted}: {key!r} is not an entry of {where}, a list of {len(node)} (indices: {valid})",
        hint=f"to replace the whole list, --set '{where}=[...]'",
    )


def _merge_section(section: dict[str, Any], value: dict[str, Any], loc: tuple[str, ...]) -> None:
    """``--set 'trainer={steps: 1}'`` sets those keys of the section and keeps its others (replacing the whole
    section would silently reset every other key to its default, ``save_every`` among them). A ``name`` in it
    switches the variant first, and the keys given with it are validated as in YAML, in any order."""
    if isinstance(value.get("name"), str):
        _drop_keys_of_other_variant(section, loc, value["name"], keep=set(value))
    for key, item in value.items():
        if isinstance(item, dict) and isinstance(section.get(key), dict):
            _merge_section(section[key], item, (*loc, str(key)))
            continue
        section[key] = item


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"] if not str(p).startswith("function-after"))
        lines.append(f"  - {loc or 'config'}: {_explain(item)}")
    return "invalid configuration:\n" + "\n".join(lines)


def _explain(item: Mapping[str, Any]) -> str:
    if item["type"] == "extra_forbidden":
        return "unknown key" + _suggestion(item)
    if item["type"] == "missing":
        return "required field is missing"
    variants = _section_at(tuple(item["loc"]))
    if isinstance(variants, dict):  # algorithm.loss / correction: name the variants
        return _variant_problem(item, variants)
    message = str(item["msg"]).removeprefix("Value error, ")
    if "input" in item and item["type"] not in ("value_error",):
        message += f" (got {item['input']!r})"
    return message


def _suggestion(item: Mapping[str, Any]) -> str:
    key, section_loc = str(item["loc"][-1]), item["loc"][:-1]
    known = _known_keys(section_loc)
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if known:
        hint += f"{' A' if close else '; a'}ccepted keys: {', '.join(sorted(known))}"
    return hint + _other_variants_hint(key, section_loc)


def _known_keys(section_loc: tuple[Any, ...]) -> list[str]:
    """The keys the config section at ``section_loc`` accepts (a variant's own keys after its tag, e.g.
    ``("algorithm", "loss", "grpo")``); [] when the location is not a section."""
    model = _section_at(section_loc)
    return list(model.model_fields) if isinstance(model, type) else []


def _section_at(loc: tuple[Any, ...]) -> type[BaseModel] | dict[str, type[BaseModel]] | None:
    """What sits at ``loc`` under :class:`RunConfig`: a section's model, ``{name: model}`` for a section with
    variants (a union discriminated by ``name``; the next part of ``loc`` is then the name), or None."""
    current: type[BaseModel] | dict[str, type[BaseModel]] | None = RunConfig
    for part in map(str, loc):
        if part.startswith("function-"):  # a validator's frame in pydantic's error location, not a key
            continue
        if isinstance(current, dict):
            current = current.get(part)
        elif current is not None:
            field = current.model_fields.get(part)
            current = _section_type(field.annotation) if field else None
    return current


def _section_type(annotation: Any) -> type[BaseModel] | dict[str, type[BaseModel]] | None:
    from typing import get_args

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    members = get_args(annotation)
    if members and all(
        isinstance(m, type) and issubclass(m, BaseModel) and "name" in m.model_fields for m in members
    ):
        # a union tagged by Literal names; a list of named entries (eval.datasets) has no tags
        return {tag: m for m in members for tag in get_args(m.model_fields["name"].annotation)} or None
    return None


def _drop_keys_of_other_variant(
    section: dict[str, Any], section_loc: tuple[str, ...], name: str, keep: set[str] | frozenset = frozenset()
) -> None:
    """Switching a variant by ``--set`` drops the old one's keys the new one does not take (``keep``: keys given
    in the same ``--set``, left for validation) – with a warning naming those set to other than the old variant's
    defaults (a setting the switch loses), never silently; defaults (compare's arms switch from them) go quietly."""
    variants = _section_at(section_loc)
    if not isinstance(variants, dict) or name not in variants or section.get("name") == name:
        return  # not a section with variants, an unknown name, or no switch: validation reports any other key
    accepted = variants[name].model_fields
    dropped = [k for k in section if k not in accepted and k not in keep]
    old = variants.get(str(section.get("name")))
    defaults = {k: f.default for k, f in old.model_fields.items()} if old is not None else {}
    lost = [k for k in dropped if k not in defaults or section[k] != defaults[k]]
    if lost:
        where = ".".join(section_loc)
        _logger.warning(
            "--set %s.name=%s drops %s: settings of %s that %s does not take (YAML with them would be an error)",
            where,
            name,
            ", ".join(f"{key}={section[key]!r}" for key in lost),
            section.get("name", "the default"),
            name,
        )
    for key in dropped:
        del section[key]


def _variant_problem(item: Mapping[str, Any], variants: dict[str, type[BaseModel]]) -> str:
    """An unknown or missing ``name`` in a section with variants: list the names and their keys."""
    loc = tuple(str(p) for p in item["loc"])
    given = item.get("input")
    if not isinstance(given, dict):
        problem = f"expected a mapping with a 'name', got {given!r}"
    elif "name" in given:
        problem = f"unknown name {given['name']!r}"
    else:
        problem = "no 'name' given"
    choices = "; ".join(f"{tag} ({_settings_of(model)})" for tag, model in variants.items())
    example = f"--set '{'.'.join(loc)}={{name: {next(iter(variants))}}}'"
    return f"{problem}; choose one of: {choices}. Example: {example}"


def _settings_of(model: type[BaseModel]) -> str:
    return ", ".join(k for k in model.model_fields if k != "name") or "no settings"


def _other_variants_hint(key: str, section_loc: tuple[Any, ...]) -> str:
    """For a key of another variant (``eps_high`` under ``loss: {name: sapo}``): which variants take it and
    how to switch."""
    if len(section_loc) < 2:
        return ""
    variants = _section_at(section_loc[:-1])
    if not isinstance(variants, dict):
        return ""
    owners = [tag for tag, model in variants.items() if key in model.model_fields]
    if not owners:
        return ""
    path = ".".join(map(str, section_loc[:-1]))
    return (
        f"; {key!r} is a setting of {path} {' / '.join(owners)}, not {section_loc[-1]}: to switch, "
        f"--set {path}.name={owners[0]}"
    )


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs as ``{dotted key: YAML value}``; the command lines of train, eval and compare."""
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set parallel.tp=2")
        try:
            overrides[key] = _override_value(value, pair)
        except yaml.YAMLError as err:
            raise ConfigError(
                f"--set {pair!r}: the value is not valid YAML ({_yaml_problem(err)})",
                hint="values are YAML: 2, 1e-5, true, [1, 2], {a: 1}; quote a string that looks like YAML, "
                f"e.g. --set \"{key}='{value}'\"",
            ) from err
    return overrides


def _override_value(value: str, pair: str) -> Any:
    """A ``--set`` value: YAML within the config file's limits (no alias bomb, no 5000-digit number); a syntax
    error is left to the caller's message."""
    return parse_yaml(value, f"--set {pair[:80]!r}", yaml_errors=True)


def _yaml_problem(err: Exception) -> str:
    """One line of a YAML error: its problem and the column it was found at."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    return f"{problem} at character {mark.column + 1}" if mark is not None else problem
