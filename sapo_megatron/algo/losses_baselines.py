"""The baselines SAPO is compared with: CISPO, GMPO, DPPO (binary TV / KL) and M2PO, each with its authors'
default settings and the diagnostics its paper reports (docs/losses.md; anchors named per class).

They share :class:`~sapo_megatron.algo.losses._PolicyLossBase` (fp32, masking, mismatch correction, KL and
entropy terms, aggregation). CISPO and DPPO are REINFORCE-style: their per-token value is the anchors'
``−sg[w]·A·logp`` (so the value equals the anchors', and the gradient is ``−w·A·∇logp``).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from sapo_megatron.algo.aggregation import AggMode, masked_mean
from sapo_megatron.algo.losses import (
    LOG_RATIO_CLAMP,
    _PolicyLossBase,
    _ratio_stats,
    _require_sequence_advantages,
    _row_mean,
    _token_ratio,
)
from sapo_megatron.algo.metric import MetricSet, Reduce, metric_set
from sapo_megatron.algo.mismatch import mismatch_metrics


class CispoLoss(_PolicyLossBase):
    """CISPO, clipped IS-weight policy optimisation (MiniMax-M1, arXiv:2506.13585).

    ``l_t = −sg[clip(r_t, min_ratio, max_ratio)]·A·logp_t``: every token keeps its gradient, only the (detached)
    importance weight is bounded. Defaults are TRL's (``loss_type="cispo"``: ``min(r, ε_max)``, ε_max = 5.0 as in
    ScaleRL, no lower bound, token-mean); verl's ``cispo`` is ``min_ratio = 1 − clip_ratio_low``,
    ``max_ratio = 1 + clip_ratio_high``.
    """

    name: Literal["cispo"] = "cispo"
    agg: AggMode = "token-mean"
    max_ratio: float = Field(
        5.0, gt=1, description="upper bound of the detached IS weight (TRL's epsilon_high)"
    )
    min_ratio: float | None = Field(None, ge=0, lt=1, description="lower bound; None = none (MiniMax, TRL)")

    def _policy_loss_bt(self, logp_bt, old_logp_bt, adv_bt, mask_bt):
        ratio_bt = _token_ratio(logp_bt, old_logp_bt).detach()
        weight_bt = ratio_bt.clamp(min=self.min_ratio, max=self.max_ratio)
        high_bt = ratio_bt > self.max_ratio
        low_bt = ratio_bt < self.min_ratio if self.min_ratio is not None else torch.zeros_like(high_bt)
        clip = {
            "clip/frac": masked_mean((high_bt | low_bt).float(), mask_bt),
            "clip/frac_high": masked_mean(high_bt.float(), mask_bt),
            "clip/frac_low": masked_mean(low_bt.float(), mask_bt),
            "cispo/weight_mean": masked_mean(weight_bt, mask_bt),
        }
        metrics = metric_set(clip, Reduce.TOKEN_MEAN, per_update=True)
        # TRL's cispo_clip_ratio: tokens whose weight was capped among those whose advantage is positive.
        capped_pos = masked_mean(high_bt.float(), mask_bt & (adv_bt > 0))
        metrics.add("cispo/frac_capped_pos", capped_pos, Reduce.POS_TOKEN_MEAN, per_update=True)
        return -weight_bt * adv_bt * logp_bt, metrics


class GmpoLoss(_PolicyLossBase):
    """GMPO, geometric-mean policy optimisation (arXiv:2507.20673; verl ``geo_mean``, callsys/GMPO).

    Per sequence: ``l_i = −A_i·exp(mean_t sgn(A)·min(sgn(A)·d_t, sgn(A)·clip(d_t, −clip_low, clip_high)))``
    with ``d_t = logp_t − old_logp_t``: token log-ratios clipped in log space, then their geometric mean. Defaults
    are the paper's ``(e^{−0.4}, e^{0.4})``. The objective is a mean over sequences, so only
    ``agg: seq-mean-token-mean`` (which weighs each sequence once) is accepted; advantages must be per sequence.
    """

    name: Literal["gmpo"] = "gmpo"
    clip_low: float = Field(0.4, gt=0, description="log-space lower clip (ratio ≥ e^-clip_low)")
    clip_high: float = Field(0.4, gt=0, description="log-space upper clip (ratio ≤ e^clip_high)")

    @model_validator(mode="after")
    def _check_agg(self) -> GmpoLoss:
        if self.agg != "seq-mean-token-mean":
            raise ValueError(
                f"gmpo is a mean over sequences of one geometric-mean ratio each: agg={self.agg!r} is undefined "
                "for it; use agg: seq-mean-token-mean"
            )
        return self

    def _policy_loss_bt(self, logp_bt, old_logp_bt, adv_bt, mask_bt):
        _require_sequence_advantages(adv_bt, mask_bt, "gmpo")
        d_bt = logp_bt - old_logp_bt
        sign_bt = torch.sign(adv_bt)
        d_clip_bt = d_bt.clamp(-self.clip_low, self.clip_high)
        d_kept_bt = sign_bt * torch.minimum(sign_bt * d_bt, sign_bt * d_clip_bt)
        log_seq_ratio_b = _row_mean(d_kept_bt, mask_bt).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        seq_ratio_b = log_seq_ratio_b.exp()
        # Every token of sequence i carries l_i: seq-mean-token-mean then averages l_i over sequences.
        loss_bt = -adv_bt * seq_ratio_b[:, None]
        clipped_bt = (d_bt != d_clip_bt).float()
        clip = {
            "clip/frac": masked_mean(clipped_bt, mask_bt),
            "clip/frac_high": masked_mean(clipped_bt * (adv_bt > 0), mask_bt),  # verl's pg_clipfrac
            "clip/frac_low": masked_mean(clipped_bt * (adv_bt < 0), mask_bt),  # verl's pg_clipfrac_lower
        }
        metrics = metric_set(clip, Reduce.TOKEN_MEAN, per_update=True)
        metrics.update(_ratio_stats("ratio/seq_", seq_ratio_b, mask_bt.any(-1), Reduce.SEQUENCE_MEAN))
        return loss_bt, metrics


class DppoLoss(_PolicyLossBase):
    """DPPO, divergence proximal policy optimisation, binary TV / KL (arXiv:2602.04879; sail-sg/Stable-RL,
    verl ``dppo_tv`` / ``dppo_kl``).

    ``l_t = −A·sg[min(r_t, ratio_cap)]·logp_t·M_t``; the trust-region mask ``M_t`` drops a token when the policy
    moved its probability too far in the direction its advantage pushes: TV ``p − p_old > delta_high`` (A > 0) or
    ``< −delta_low`` (A ≤ 0); KL: the binary KL ``p_old·log(p_old/p) + (1−p_old)·log((1−p_old)/(1−p))`` above
    ``delta_high`` while ``p > p_old`` (A > 0), above ``delta_low`` while ``p < p_old`` (A ≤ 0). Defaults are the
    authors' recipe (TV 0.15, KL 0.05, ``ratio_cap`` off; they train with ``seq-mean-token-sum-norm``).
    """

    name: Literal["dppo_tv", "dppo_kl"] = "dppo_tv"
    agg: AggMode = "token-mean"
    delta_low: float | None = Field(None, gt=0, description="None: 0.15 (TV) / 0.05 (KL)")
    delta_high: float | None = Field(None, gt=0, description="None: 0.15 (TV) / 0.05 (KL)")
    ratio_cap: float | None = Field(None, gt=1, description="verl's clip_ratio_c on the weight; None = off")

    @model_validator(mode="after")
    def _default_deltas(self) -> DppoLoss:
        default = 0.15 if self.name == "dppo_tv" else 0.05
        for field in ("delta_low", "delta_high"):
            if getattr(self, field) is None:
                object.__setattr__(self, field, default)
        return self

    def _policy_loss_bt(self, logp_bt, old_logp_bt, adv_bt, mask_bt):
        ratio_bt = _token_ratio(logp_bt, old_logp_bt).detach()
        weight_bt = ratio_bt if self.ratio_cap is None else ratio_bt.clamp(max=self.ratio_cap)
        valid_bt = self._trust_region(logp_bt.detach(), old_logp_bt, adv_bt)
        dropped_bt = (~valid_bt).float()
        clip = {
            "clip/frac": masked_mean(dropped_bt, mask_bt),
            "clip/frac_high": masked_mean(dropped_bt * (adv_bt > 0), mask_bt),
            "clip/frac_low": masked_mean(dropped_bt * (adv_bt <= 0), mask_bt),
        }
        if self.ratio_cap is not None:
            clip["dppo/frac_ratio_capped"] = masked_mean((ratio_bt > self.ratio_cap).float(), mask_bt)
        metrics = metric_set(clip, Reduce.TOKEN_MEAN, per_update=True)
        return -adv_bt * weight_bt * logp_bt * valid_bt.float(), metrics

    def _trust_region(self, logp_bt, old_logp_bt, adv_bt) -> torch.Tensor:
        p_bt, p_old_bt = logp_bt.exp(), old_logp_bt.exp()
        low, high = float(self.delta_low or 0.0), float(self.delta_high or 0.0)  # set by _default_deltas
        if self.name == "dppo_tv":
            valid_pos, valid_neg = p_bt - p_old_bt <= high, p_bt - p_old_bt >= -low
        else:
            # verl's binary KL, with its 1e-8 guard on the complement probabilities.
            kl_bt = p_old_bt * (old_logp_bt - logp_bt) + (1.0 - p_old_bt) * torch.log(
                (1.0 - p_old_bt + 1e-8) / (1.0 - p_bt + 1e-8)
            )
            valid_pos = (kl_bt <= high) | (p_bt <= p_old_bt)
            valid_neg = (kl_bt <= low) | (p_bt >= p_old_bt)
        return torch.where(adv_bt > 0, valid_pos, valid_neg)


class M2poLoss(_PolicyLossBase):
    """M2PO, second-moment trust policy optimisation (arXiv:2510.01161; AReaL ``actor.m2_threshold``).

    The tokens of this call with the largest second moment ``M2_t = (rollout_logp − old_logp)²`` (behaviour vs
    proximal policy) are dropped, largest first, until the mean M2 of the rest is below ``m2_threshold`` (0.04,
    AReaL's example); the rest train on the unclipped ``l_t = −r_t·A`` (the paper's objective). Needs
    ``rollout_logp_bt``. The dropped tokens leave the loss mask, so a single call divides by the kept tokens as
    AReaL does; with the hook's global normalisers (counted before masking) they weigh 1/N like AReaL's rejection
    masks. Like AReaL, the mask is taken per call (micro-batch), so it depends on the micro-batch split whenever
    it drops anything (``m2po/frac_masked`` > 0).
    """

    name: Literal["m2po"] = "m2po"
    agg: AggMode = "token-mean"
    m2_threshold: float = Field(0.04, gt=0)

    def compute(self, logp_bt, old_logp_bt, adv, mask_bt, **kwargs):
        """As :meth:`_PolicyLossBase.compute` on the tokens M2PO keeps (:func:`m2po_keep_mask`)."""
        rollout_logp_bt = kwargs.pop("rollout_logp_bt", None)
        if rollout_logp_bt is None:
            raise ValueError(
                "m2po needs rollout_logp_bt (the engine's log-probs: M2 = (rollout − old)²); pass it or pick "
                "another loss"
            )
        mask = mask_bt.bool()
        keep_bt = m2po_keep_mask(old_logp_bt.detach(), rollout_logp_bt.detach(), mask, self.m2_threshold)
        # As in AReaL, the dropped tokens leave the loss mask: policy, KL and entropy terms, local normalisers.
        loss, metrics = super().compute(
            logp_bt, old_logp_bt, adv, mask & keep_bt, rollout_logp_bt=rollout_logp_bt, **kwargs
        )
        # The engine–trainer mismatch is a property of the samples: measured on every token, not just the kept.
        metrics.update(mismatch_metrics(old_logp_bt.detach(), rollout_logp_bt.detach(), mask))
        m2_bt = (rollout_logp_bt.float() - old_logp_bt.float()).detach() ** 2
        m2po = {
            "m2po/frac_masked": masked_mean((~keep_bt).float(), mask),
            "m2po/m2_mean": masked_mean(torch.where(mask, m2_bt, 0.0), mask),
            "m2po/m2_mean_kept": masked_mean(torch.where(mask, m2_bt, 0.0), mask & keep_bt),
        }
        metrics.update(metric_set(m2po, Reduce.TOKEN_MEAN, per_update=True))
        return loss, metrics

    def _policy_loss_bt(self, logp_bt, old_logp_bt, adv_bt, mask_bt):
        return -_token_ratio(logp_bt, old_logp_bt) * adv_bt, MetricSet()


def m2po_keep_mask(
    old_logp_bt: torch.Tensor, rollout_logp_bt: torch.Tensor, mask_bt: torch.Tensor, threshold: float
) -> torch.Tensor:
    """``[batch, seq]`` bool: the valid tokens M2PO keeps. Sorting M2 descending, drop the first k tokens for the
    smallest k whose remaining mean M2 is below ``threshold`` (all but one if none is)."""
    mask = mask_bt.bool()
    m2 = (old_logp_bt.float() - rollout_logp_bt.float())[mask] ** 2
    keep = torch.zeros_like(mask)
    n = m2.numel()
    if n == 0:
        return keep
    sorted_m2, order = torch.sort(m2, descending=True)
    suffix_mean = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, device=m2.device)
    below = torch.nonzero(suffix_mean < threshold)
    num_dropped = int(below[0, 0]) if below.numel() else n - 1
    kept_sorted = torch.arange(n, device=m2.device) >= num_dropped
    kept = torch.empty_like(kept_sorted)
    kept[order] = kept_sorted
    keep[mask] = kept
    return keep
