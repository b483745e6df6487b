"""Training–inference mismatch: importance weights and metrics (ALGORITHMS.md, "Training–inference mismatch").

``δ_t = old_logp_t − rollout_logp_t``: the trainer's and the rollout engine's log-probability of the same sampled
token at the same parameters. ``exp(δ)`` is the importance ratio π_trainer / π_engine.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sapo_megatron.algo.aggregation import masked_mean
from sapo_megatron.algo.metric import MetricSet, Reduce, metric_set

LOG_RATIO_CLAMP = 20.0  # exp(20) ≈ 4.9e8: finite in fp32, far beyond any meaningful ratio


class NoCorrection(BaseModel):
    """Train on the rollout samples as if the engine were the trainer (weight 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["none"] = "none"

    def weight(self, delta_bt: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(delta_bt)


class TIS(BaseModel):
    """Truncated importance sampling: weight ``min(exp(δ), cap)`` (Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training")."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["tis"] = "tis"
    cap: float = Field(2.0, gt=0)

    def weight(self, delta_bt: torch.Tensor) -> torch.Tensor:
        return delta_bt.exp().clamp(max=self.cap)


class IcePop(BaseModel):
    """Masked importance sampling: weight ``exp(δ)`` inside ``[low, high]``, else 0 (the token is dropped)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["icepop"] = "icepop"
    low: float = Field(0.5, gt=0)
    high: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _check_band(self) -> IcePop:
        if self.low >= self.high:
            raise ValueError(f"icepop needs low < high, got low={self.low}, high={self.high}")
        return self

    def weight(self, delta_bt: torch.Tensor) -> torch.Tensor:
        ratio_bt = delta_bt.exp()
        return torch.where((ratio_bt >= self.low) & (ratio_bt <= self.high), ratio_bt, 0.0)


MismatchCorrection = NoCorrection | TIS | IcePop
MismatchCorrectionConfig = Annotated[MismatchCorrection, Field(discriminator="name")]


def correction_weights(
    correction: MismatchCorrection | None,
    old_logp_bt: torch.Tensor,
    rollout_logp_bt: torch.Tensor | None,
) -> torch.Tensor | None:
    """Detached fp32 per-token weights ``[batch, seq]`` that multiply the token loss; None for no correction."""
    if correction is None or correction.name == "none":
        return None
    if rollout_logp_bt is None:
        raise ValueError(
            f"mismatch correction {correction.name!r} needs rollout_logp_bt (the engine's log-probs); "
            "pass it or use correction=NoCorrection()"
        )
    delta_bt = _delta(old_logp_bt, rollout_logp_bt)
    # Detached: the weight corrects the sampling distribution, it is not something to optimise.
    return correction.weight(delta_bt).detach()


def mismatch_metrics(
    old_logp_bt: torch.Tensor, rollout_logp_bt: torch.Tensor, mask_bt: torch.Tensor
) -> MetricSet:
    """Masked means over valid tokens of ``[batch, seq]`` inputs: k3 KL estimate, mean |δ|, and the fraction of
    tokens whose ratio ``exp(δ)`` is above 2 or below 0.5."""
    delta_bt = _delta(old_logp_bt, rollout_logp_bt).detach()
    ratio_bt = delta_bt.exp()
    means = {
        "mismatch/k3": masked_mean(ratio_bt - delta_bt - 1.0, mask_bt),
        "mismatch/abs_delta_mean": masked_mean(delta_bt.abs(), mask_bt),
        "mismatch/frac_ratio_gt_2": masked_mean((ratio_bt > 2.0).float(), mask_bt),
        "mismatch/frac_ratio_lt_0.5": masked_mean((ratio_bt < 0.5).float(), mask_bt),
    }
    return metric_set(means, Reduce.TOKEN_MEAN)


def _delta(old_logp_bt: torch.Tensor, rollout_logp_bt: torch.Tensor) -> torch.Tensor:
    return (old_logp_bt.float() - rollout_logp_bt.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
