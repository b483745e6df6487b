"""The ``rollout`` section: which engine generates the samples, where its servers are, how the trainer's weights
reach it, whether it shares the trainer's devices, and multi-turn episodes (read by ``sapo_megatron/rollout/``,
:mod:`sapo_megatron.loop.session` and :mod:`sapo_megatron.loop.colocation`).

``rollout.engine`` is one choice of three (:data:`EngineKind`): ``cpu`` (the CPU engine in the trainer's process),
``cpu_http`` (the same engine behind its SGLang-compatible HTTP server, used through the SGLang client) and
``sglang`` (SGLang servers). ``rollout.colocation`` is one choice of three (:data:`ColocationConfig`): ``none``
(the servers have their own devices), ``split`` (they sit on the trainer's GPUs with a fixed share of memory)
and ``time_shared`` (:class:`ColocateConfig`: engine and trainer take turns). The keys they replace
(``cpu_http``, ``colocated``, ``colocate``) are read until the next release (:mod:`sapo_megatron.config.deprecated`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from sapo_megatron.config_section import Section

EngineKind = Literal["cpu", "cpu_http", "sglang"]
"""``cpu``: the CPU engine in process; ``cpu_http``: it behind its HTTP server (what an SGLang server does, on
CPU); ``sglang``: SGLang servers (``urls``, ``router_url`` or ``endpoints_file``)."""
CPU_ENGINES: tuple[str, ...] = ("cpu", "cpu_http")
"""The engine kinds that load a checkpoint into the CPU engine of this process."""


class NotColocated(Section):
    """``rollout.colocation: none``: the servers run on devices of their own (the default)."""

    name: Literal["none"] = "none"


class SplitColocation(Section):
    """``rollout.colocation: split``: SGLang servers on the trainer's GPUs, each keeping a fixed share of memory
    (their ``--mem-fraction-static``; the planner's ``--rollout-mem-fraction``). Weight sync ``tensor`` needs it."""

    name: Literal["split"] = "split"


class ColocateConfig(Section):
    """``rollout.colocation: time_shared``, the colocated step (sapo_megatron/loop/colocation.py, docs/cluster.md
    "Colocated training"): the engine releases its memory while the trainer trains, then takes it back and
    receives the new weights."""

    name: Literal["time_shared"] = "time_shared"
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


ColocationConfig = Annotated[NotColocated | SplitColocation | ColocateConfig, Field(discriminator="name")]
"""``rollout.colocation``: ``none``, ``split`` or ``time_shared`` (a bare name stands for ``{name: ...}``)."""


class RolloutConfig(Section):
    """Where samples come from (``engine``, :data:`EngineKind`): the CPU engine (in-process, or behind its
    SGLang-compatible HTTP server) or SGLang servers (workers), optionally behind an ``sglang-router`` that
    balances ``/generate``.

    Topology (engine: sglang): ``urls`` lists the workers; ``router_url`` is used for ``/generate`` only; weight
    sync, ``/flush_cache``, health and model info go to every worker. With only ``router_url``, the workers are
    read from the router (``GET /workers``). ``endpoints_file`` is the JSON that ``launch/slurm_rollout.sbatch``
    writes (``{"router_url": ..., "workers": [...]}``); the trainer waits for it and for healthy servers.
    """

    engine: EngineKind = Field(
        default="cpu",
        description="cpu (the CPU engine in the trainer's process), cpu_http (it behind its SGLang-compatible HTTP "
        "server, used through the SGLang client) or sglang (SGLang servers: urls, router_url or endpoints_file)",
    )
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
    colocation: ColocationConfig = Field(
        default_factory=NotColocated,
        description="none (servers on their own devices), split (SGLang servers on the trainer's GPUs with a fixed "
        "memory share; needed for weight_sync: tensor with sglang) or time_shared (engine and trainer take turns: "
        "release the engine while training, offload the trainer while generating; engine sglang or cpu_http)",
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

    @model_validator(mode="before")
    @classmethod
    def _colocation_by_name(cls, data: Any) -> Any:
        """``colocation: split`` is short for ``colocation: {name: split}``."""
        if isinstance(data, dict) and isinstance(data.get("colocation"), str):
            return {**data, "colocation": {"name": data["colocation"]}}
        return data

    @property
    def shares_devices(self) -> bool:
        """The engine sits on the trainer's devices (``colocation`` split or time_shared)."""
        return self.colocation.name != "none"

    @property
    def time_shared(self) -> ColocateConfig | None:
        """The colocated step's settings when engine and trainer take turns, else None."""
        return self.colocation if isinstance(self.colocation, ColocateConfig) else None

    @model_validator(mode="after")
    def _check_engine(self) -> RolloutConfig:
        given = [name for name in ("urls", "router_url", "endpoints_file") if getattr(self, name)]
        if self.engine == "sglang" and not given:
            raise ValueError(
                "rollout.engine=sglang needs rollout.urls (worker URLs), rollout.router_url or "
                "rollout.endpoints_file (written by launch/slurm_rollout.sbatch)"
            )
        if self.engine != "sglang" and given:
            raise ValueError(
                f"rollout.{given[0]} is only used with rollout.engine=sglang; remove it or change the engine"
            )
        if self.endpoints_file and (self.urls or self.router_url):
            raise ValueError(
                "rollout.endpoints_file already names the router and the workers; drop rollout.urls / "
                "rollout.router_url, or drop endpoints_file"
            )
        if self.weight_sync is None:
            self.weight_sync = "tensor" if self.engine in CPU_ENGINES else "distributed"
        if self.weight_sync == "tensor" and self.engine == "sglang" and not self.shares_devices:
            raise ValueError(
                "rollout.weight_sync=tensor hands tensors to the servers by CUDA IPC, which works only when they "
                "run on the trainer's GPUs; use weight_sync: distributed (broadcast to remote servers) or disk "
                "(shared filesystem), or set rollout.colocation: split if the servers are colocated"
            )
        if self.time_shared is not None:
            self._check_time_shared(self.time_shared)
        if self.weight_sync == "distributed" and self.engine in CPU_ENGINES:
            raise ValueError(
                "rollout.weight_sync=distributed broadcasts to servers in other processes (engine: sglang, e.g. "
                "CPU servers started with `sapo-megatron serve`); the CPU engine in the trainer's process takes "
                "weight_sync: tensor or disk"
            )
        return self

    def _check_time_shared(self, colocate: ColocateConfig) -> None:
        if self.engine == "cpu":
            raise ValueError(
                "rollout.colocation=time_shared releases and resumes the engine over SGLang's HTTP API; the "
                "in-process CPU engine has none: set rollout.engine: cpu_http"
            )
        if colocate.check_weights and self.weight_sync != "tensor":
            raise ValueError(
                "rollout.colocation.check_weights hashes the tensor sync's buckets; it needs weight_sync: tensor"
            )
        if colocate.check_weights and self.precision == "fp8":
            raise ValueError(
                "rollout.colocation.check_weights compares exact bytes; an fp8 server holds requantized weights: "
                "turn it off for rollout.precision fp8"
            )
