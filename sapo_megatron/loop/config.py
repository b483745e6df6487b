"""The ``trainer`` and ``sft`` sections: the RL loop's steps, batch sizes and checkpoint cadence, and the
supervised warm start before it (read by :mod:`sapo_megatron.loop.trainer`)."""

from __future__ import annotations

from pydantic import Field

from sapo_megatron.config_section import Section


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
