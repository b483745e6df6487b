"""Training–inference mismatch: importance weights and metrics (ALGORITHMS.md, "Training–inference mismatch").

``δ_t = old_logp_t − rollout_logp_t``: the trainer's and the rollout engine's log-probability of the same sampled
token at the same parameters. ``exp(δ)`` is the importance ratio π_trainer / π_engine.
"""

from __future__ import annotations

import math
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


RejectStat = Literal[
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
]


class RejectRule(BaseModel):
    """One verl ``rollout_rs`` option: a divergence statistic of ``δ`` per token or per sequence, and its bounds.

    ``k1 = −δ``, ``k2 = δ²/2``, ``k3 = e^δ − 1 − δ`` per token; ``seq_sum`` / ``seq_mean`` / ``seq_max`` over the
    sequence's tokens. ``*_k1`` keeps ``log(lower) ≤ k1 ≤ log(upper)`` (both needed; as in verl's code this keeps
    the ratio ``e^δ`` in ``[1/upper, 1/lower]``, the same band when ``lower = 1/upper``); ``k2``/``k3`` keep
    ``stat ≤ upper``. ``seq_mean_k1`` is verl's geometric rejection (the geometric-mean ratio of the sequence).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    stat: RejectStat
    upper: float = Field(gt=0)
    lower: float | None = Field(None, gt=0, description="k1 statistics only")

    @model_validator(mode="after")
    def _check_bounds(self) -> RejectRule:
        if self.stat.endswith("k1") and (self.lower is None or self.lower >= self.upper):
            raise ValueError(
                f"reject rule {self.stat} needs lower < upper (ratio bounds), got lower={self.lower}"
            )
        if not self.stat.endswith("k1") and self.lower is not None:
            raise ValueError(f"reject rule {self.stat} takes only upper (lower is for the k1 statistics)")
        return self

    def keep(self, delta_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
        """``[batch, seq]`` bool: the tokens this rule keeps (whole sequences for the ``seq_*`` statistics)."""
        estimator = self.stat.rsplit("_", 1)[1]
        token_bt = {"k1": -delta_bt, "k2": 0.5 * delta_bt**2, "k3": delta_bt.exp() - 1.0 - delta_bt}[
            estimator
        ]
        if self.stat.startswith("token"):
            stat = token_bt
        elif self.stat.startswith("seq_sum"):
            stat = torch.where(mask_bt, token_bt, 0.0).sum(-1, keepdim=True)
        elif self.stat.startswith("seq_mean"):
            stat = torch.where(mask_bt, token_bt, 0.0).sum(-1, keepdim=True) / mask_bt.sum(
                -1, keepdim=True
            ).clamp(min=1)
        else:
            row_max = torch.where(mask_bt, token_bt, -torch.inf).amax(-1, keepdim=True)
            stat = torch.where(torch.isinf(row_max), 0.0, row_max)
        if estimator == "k1":
            keep = (stat >= math.log(self.lower)) & (stat <= math.log(self.upper))  # type: ignore[arg-type]
        else:
            keep = stat <= self.upper
        return keep.expand_as(mask_bt)


class RolloutCorrection(BaseModel):
    """verl's rollout correction (``docs/algo/rollout_corr.md``): an importance weight at the token, sequence
    or geometric level, truncated at ``is_threshold``, times the rejection masks of ``reject`` (all must keep).

    - ``is_level: token``: ``min(e^{δ_t}, C)``; ``sequence``: ``min(e^{Σ_t δ_t}, C)`` on every token of the
      sequence (log-sum clamped to ±20 as verl); ``geometric``: ``min(e^{mean_t δ_t}, C)``; ``null``: weight 1
      (rejection only).
    - Rejected tokens get weight 0; the normalisers still count them (verl drops them from the response mask).
    - ``is_batch_normalize`` (verl's ``rollout_is_batch_normalize``): the truncated weights divided by their
      mean over the whole batch (token level: over every valid token; sequence / geometric level: over the
      sequences with a valid token, one weight each), after truncation and before the rejection masks, so the
      batch's mean weight is 1. The batch is the RL step's rollout batch on every data-parallel rank (the loop
      passes its mean, :meth:`batch_sums`); a direct call normalises over the tensors it is given.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["rollout_corr"] = "rollout_corr"
    is_level: Literal["token", "sequence", "geometric"] | None = "token"
    is_threshold: float = Field(2.0, gt=0, description="truncation cap C of the IS weight (verl's default 2)")
    is_batch_normalize: bool = Field(
        False,
        description="divide the truncated IS weights by their batch mean (verl rollout_is_batch_normalize)",
    )
    reject: list[RejectRule] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_normalize(self) -> RolloutCorrection:
        if self.is_batch_normalize and self.is_level is None:
            raise ValueError(
                "rollout_corr is_batch_normalize needs an IS weight to normalise: set is_level (token, sequence "
                "or geometric) or is_batch_normalize: false"
            )
        return self

    def weight_masked(
        self, delta_bt: torch.Tensor, mask_bt: torch.Tensor, batch_mean: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[batch, seq]``: truncated IS weight (divided by ``batch_mean`` under ``is_batch_normalize``; None:
        the mean over these tensors) times the rejection masks (0 off ``mask_bt``)."""
        weight_bt = self.raw_is_weight(delta_bt, mask_bt).clamp(max=self.is_threshold)
        if self.is_batch_normalize:
            weight_bt = weight_bt / self.norm_factor(delta_bt, mask_bt, batch_mean)
        return torch.where(mask_bt & self.keep(delta_bt, mask_bt), weight_bt, 0.0)

    def batch_sums(self, delta_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
        """fp64 ``[2]``: the sum of the truncated IS weights and their count – over valid tokens (token level)
        or over sequences with a valid token, one weight each (sequence / geometric level) – to be summed over
        a batch's micro-batches and ranks; their ratio is the batch mean ``is_batch_normalize`` divides by."""
        weight_bt = self.raw_is_weight(delta_bt, mask_bt).clamp(max=self.is_threshold).double()
        if self.is_level == "token":
            return torch.stack((weight_bt[mask_bt].sum(), mask_bt.sum().double()))
        has_tokens = mask_bt.any(-1)
        return torch.stack((weight_bt[:, 0][has_tokens].sum(), has_tokens.sum().double()))

    def norm_factor(
        self, delta_bt: torch.Tensor, mask_bt: torch.Tensor, batch_mean: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The divisor of ``is_batch_normalize``: ``batch_mean`` (or these tensors' mean), 1 when it is not
        above 1e-8 (as verl)."""
        if batch_mean is None:
            total, count = self.batch_sums(delta_bt, mask_bt)
            batch_mean = total / count.clamp(min=1)
        batch_mean = batch_mean.to(device=delta_bt.device, dtype=torch.float32)
        return torch.where(batch_mean > 1e-8, batch_mean, torch.ones_like(batch_mean))

    def raw_is_weight(self, delta_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
        """The IS weight before truncation, broadcast to ``[batch, seq]`` (ones for ``is_level: null``)."""
        if self.is_level is None:
            return torch.ones_like(delta_bt)
        if self.is_level == "token":
            return delta_bt.exp()
        log_w = torch.where(mask_bt, delta_bt, 0.0).sum(-1, keepdim=True)
        if self.is_level == "geometric":
            log_w = log_w / mask_bt.sum(-1, keepdim=True).clamp(min=1)
        return log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().expand_as(delta_bt)

    def keep(self, delta_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
        keep = torch.ones_like(mask_bt)
        for rule in self.reject:
            keep = keep & rule.keep(delta_bt, mask_bt)
        return keep

    def metrics(
        self, delta_bt: torch.Tensor, mask_bt: torch.Tensor, batch_mean: torch.Tensor | None = None
    ) -> MetricSet:
        """Token means: the weight after truncation, normalisation and rejection, the share truncated, the share
        rejected in all and per rule; under ``is_batch_normalize`` the divisor (verl's
        ``rollout_is_batch_norm_factor``)."""
        raw_bt = self.raw_is_weight(delta_bt, mask_bt)
        out = {
            "rollout_corr/weight_mean": masked_mean(
                self.weight_masked(delta_bt, mask_bt, batch_mean), mask_bt
            ),
            "rollout_corr/truncated_frac": masked_mean((raw_bt > self.is_threshold).float(), mask_bt),
            "rollout_corr/rejected_frac": masked_mean((~self.keep(delta_bt, mask_bt)).float(), mask_bt),
        }
        for rule in self.reject:
            out[f"rollout_corr/rejected_frac_{rule.stat}"] = masked_mean(
                (~rule.keep(delta_bt, mask_bt)).float(), mask_bt
            )
        if self.is_batch_normalize:
            factor = self.norm_factor(delta_bt, mask_bt, batch_mean)
            out["rollout_corr/batch_norm_factor"] = factor
        return metric_set(out, Reduce.TOKEN_MEAN)


MismatchCorrection = NoCorrection | TIS | IcePop | RolloutCorrection
MismatchCorrectionConfig = Annotated[MismatchCorrection, Field(discriminator="name")]


def correction_weights(
    correction: MismatchCorrection | None,
    old_logp_bt: torch.Tensor,
    rollout_logp_bt: torch.Tensor | None,
    mask_bt: torch.Tensor | None = None,
    is_weight_mean: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Detached fp32 per-token weights ``[batch, seq]`` that multiply the token loss; None for no correction.
    ``mask_bt`` (the valid tokens) is needed by :class:`RolloutCorrection`'s sequence-level weights and rules;
    ``is_weight_mean`` is the batch mean its ``is_batch_normalize`` divides by (None: over these tensors)."""
    if correction is None or correction.name == "none":
        return None
    if rollout_logp_bt is None:
        raise ValueError(
            f"mismatch correction {correction.name!r} needs rollout_logp_bt (the engine's log-probs); "
            "pass it or use correction=NoCorrection()"
        )
    delta_bt = _delta(old_logp_bt, rollout_logp_bt)
    # Detached: the weight corrects the sampling distribution, it is not something to optimise.
    if isinstance(correction, RolloutCorrection):
        if mask_bt is None:
            raise ValueError("rollout_corr needs mask_bt (its sequence-level weights sum over valid tokens)")
        return correction.weight_masked(delta_bt, mask_bt.bool(), is_weight_mean).detach()
    return correction.weight(delta_bt).detach()


def correction_metrics(
    correction: MismatchCorrection | None,
    old_logp_bt: torch.Tensor,
    rollout_logp_bt: torch.Tensor | None,
    mask_bt: torch.Tensor,
    is_weight_mean: torch.Tensor | None = None,
) -> MetricSet:
    """The correction's own diagnostics (``rollout_corr/*``, token means); empty for none / TIS / IcePop."""
    if not isinstance(correction, RolloutCorrection) or rollout_logp_bt is None:
        return MetricSet()
    delta_bt = _delta(old_logp_bt, rollout_logp_bt).detach()
    return correction.metrics(delta_bt, mask_bt.bool(), is_weight_mean)


def correction_batch_sums(
    correction: MismatchCorrection | None,
    old_logp_bt: torch.Tensor,
    rollout_logp_bt: torch.Tensor,
    mask_bt: torch.Tensor,
) -> torch.Tensor | None:
    """fp64 ``[2]`` (sum, count) of a batch-normalised :class:`RolloutCorrection`'s truncated IS weights on
    these tensors, to be summed over the batch (:meth:`RolloutCorrection.batch_sums`); None when the
    correction does not normalise over the batch."""
    if not isinstance(correction, RolloutCorrection) or not correction.is_batch_normalize:
        return None
    return correction.batch_sums(_delta(old_logp_bt, rollout_logp_bt).detach(), mask_bt.bool())


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
