"""The ``trainer`` and ``sft`` sections: the RL loop's steps, batch sizes and checkpoint cadence, and the
supervised warm start before it (read by :mod:`sapo_megatron.loop.trainer`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sapo_megatron.config_section import Section

RolloutMode = Literal["sync", "one_step_off", "fully_async"]
ROLLOUT_MODES: tuple[str, ...] = ("sync", "one_step_off", "fully_async")


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
    rollout_mode: RolloutMode = Field(
        default="sync",
        description="sync: each batch generated, then trained; one_step_off: batch n+1 generated while batch n "
        "trains (rollout/staleness 1); fully_async: generation runs on into a bounded buffer of finished groups "
        "and each step trains groups at most max_staleness policy versions behind (docs/async.md)",
    )
    max_staleness: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="fully_async: how many policy versions a token may be behind the trainer when it is trained",
    )
    stale_groups: Literal["drop", "correct"] = Field(
        default="drop",
        description="fully_async: a group past max_staleness is dropped, or trained with algorithm.correction "
        "(the decoupled objective's proximal / behaviour weight) – correct needs a correction",
    )
    async_chunk_groups: int | None = Field(
        default=None,
        ge=1,
        description="fully_async: prompt groups per generation call of the producer (null: prompts_per_step); "
        "smaller chunks keep a weight update's wait for the chunk in flight short",
    )
    async_inflight_chunks: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="fully_async: chunks the producer generates at once, each entering the buffer when it "
        "finishes (short samples flow in while long ones keep generating on an engine that batches "
        "continuously, e.g. SGLang); 1: one chunk at a time. Not with fully_async_deterministic",
    )
    async_buffer_groups: int | None = Field(
        default=None,
        ge=1,
        description="fully_async: finished groups the buffer holds at most (null: (max_staleness + 1) × "
        "prompts_per_step); at least prompts_per_step",
    )
    fully_async_deterministic: bool = Field(
        default=False,
        description="fully_async without a thread: generation happens at fixed points (before each step, up to "
        "the staleness bound), so staleness numbers are exact (tests, benchmarks of the schedule)",
    )
    pause_mode: Literal["in_place", "retract", "abort", "none"] = Field(
        default="in_place",
        description="fully_async: a weight update that would wait for the chunk in flight pauses the engine in this "
        "mode (SGLang's /pause_generation), syncs and continues; samples spanning it carry per-token versions. "
        "none: wait for the chunk in flight (whole samples). retract is refused with algorithm.routing_replay: r3 "
        "on server engines (SGLang returns the re-prefill's routes for the prefix: miles #3277)",
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

    @property
    def async_rollout(self) -> bool:
        """The previous release's ``trainer.async_rollout``: one step off-policy."""
        return self.rollout_mode == "one_step_off"
