"""The ``algorithm`` section: the RL objective (policy loss, mismatch correction, advantages, teacher fusion),
the reward and the sampling rules (read by the loop, the loss hook and the reward runner)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from sapo_megatron.algo import (
    AdvantageConfig,
    FusionConfig,
    MismatchCorrectionConfig,
    NoCorrection,
    PolicyLossConfig,
    RlFusion,
    SapoLoss,
)
from sapo_megatron.config_section import Section


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
    proximal_logp: Literal["recompute", "loglinear"] = Field(
        default="recompute",
        description="the proximal policy of the decoupled objective (docs/async.md): recompute runs the "
        "old-policy forward pass; loglinear skips it and interpolates between the engine's (behaviour) and the "
        "current log-prob by each token's staleness s, alpha = s/(s+1) (AReaL's prox_logp_method: loglinear)",
    )
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


def reward_label(spec: str | RemoteRewardConfig | list[str | WeightedReward]) -> str:
    """``algorithm.reward`` as one readable phrase for messages: ``acc.py:fn + 0.5 × fmt.py:fn``, a URL."""
    if isinstance(spec, list):
        return " + ".join(reward_label_part(part) for part in spec)
    return spec.url if isinstance(spec, RemoteRewardConfig) else spec


def reward_label_part(part: str | WeightedReward) -> str:
    if isinstance(part, str):
        return part
    inner = reward_label(part.reward)
    return inner if part.weight == 1.0 else f"{part.weight:g} × {inner}"
