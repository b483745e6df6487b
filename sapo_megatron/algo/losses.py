"""Policy losses: SAPO, GRPO/DAPO (PPO-clip) and GSPO / GSPO-token, each a frozen pydantic model that owns its
settings and computes ``(loss, metrics)`` from ``[batch, seq]`` tensors (formulas: docs ALGORITHMS.md).

Common to every loss (:meth:`_PolicyLossBase.compute`):

- inputs are cast to fp32 and zeroed on masked tokens, so padding can never leak into the loss or its gradient;
  ``old_logp``, advantages and the reference/rollout log-probs are detached (they are targets, not parameters);
- the per-token loss is multiplied by the detached mismatch-correction weight (TIS / IcePop), then aggregated
  with the configured ``agg`` mode and the optional global normalisers (see ``aggregation.py``);
- ``loss = agg(l_pg · w_is) + kl_coef · agg(k3(ref ‖ π)) − entropy_coef · agg(entropy)``; the KL and entropy
  terms are not importance-weighted.

Metrics are detached 0-d fp32 tensors in a :class:`~sapo_megatron.algo.metric.MetricSet`, each made with its
reduction: a masked mean over the valid tokens of *this* call (token mean; over the positive- / negative-advantage
tokens for the ``*_pos`` / ``*_neg`` gate means), a mean over sequences (sequence ratios, the SAPO gate's spread,
GSPO's per-sequence clip fractions), a sum (``loss/*``: this call's share of the loss) or an extremum (``ratio/*min``,
``ratio/*max``). Empty selections give 0 (ratios: 1).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sapo_megatron.algo.aggregation import AggMode, Normaliser, aggregate, masked_mean
from sapo_megatron.algo.metric import MetricSet, Reduce, metric_set
from sapo_megatron.algo.mismatch import (
    LOG_RATIO_CLAMP,
    MismatchCorrection,
    correction_metrics,
    correction_weights,
    mismatch_metrics,
)

Metrics = MetricSet


class _PolicyLossBase(BaseModel):
    """Settings shared by every policy loss, and the common ``compute`` pipeline."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    agg: AggMode = "seq-mean-token-mean"
    max_len: int | None = Field(None, gt=0, description="L_max of seq-mean-token-sum-norm (Dr.GRPO)")
    kl_coef: float = Field(0.0, ge=0, description="weight of the k3 KL to the reference policy")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus (subtracted)")

    @model_validator(mode="after")
    def _check_max_len(self) -> _PolicyLossBase:
        if self.agg == "seq-mean-token-sum-norm" and self.max_len is None:
            raise ValueError(
                "agg='seq-mean-token-sum-norm' needs max_len (the L_max of the Dr.GRPO normaliser)"
            )
        return self

    def compute(
        self,
        logp_bt: torch.Tensor,
        old_logp_bt: torch.Tensor,
        adv: torch.Tensor,
        mask_bt: torch.Tensor,
        *,
        rollout_logp_bt: torch.Tensor | None = None,
        ref_logp_bt: torch.Tensor | None = None,
        entropy_bt: torch.Tensor | None = None,
        correction: MismatchCorrection | None = None,
        num_sequences: Normaliser | None = None,
        num_tokens: Normaliser | None = None,
        is_weight_mean: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Metrics]:
        """Scalar loss to minimise, and metrics.

        ``logp_bt``/``old_logp_bt``/``mask_bt``: ``[batch, seq]``; ``adv``: ``[batch]`` (one per sequence) or
        ``[batch, seq]``; optional ``rollout_logp_bt`` (engine log-probs, for ``correction`` and mismatch
        metrics), ``ref_logp_bt`` (for ``kl_coef``), ``entropy_bt`` (for ``entropy_coef``), all ``[batch, seq]``.
        ``num_sequences``/``num_tokens``: global normalisers, see ``aggregation.token_weights``;
        ``is_weight_mean``: the batch mean of a ``rollout_corr`` correction's truncated IS weights, which its
        ``is_batch_normalize`` divides by (None: the mean over these tensors; ``mismatch.correction_batch_sums``).
        """
        mask = mask_bt.bool()
        _check_shape("logp_bt", logp_bt, mask)
        _check_shape("old_logp_bt", old_logp_bt, mask)
        logp = _valid(logp_bt, mask)
        old = _valid(old_logp_bt, mask).detach()
        adv_bt = _valid(_broadcast_adv(adv, mask), mask).detach()
        rollout = _optional_valid("rollout_logp_bt", rollout_logp_bt, mask)

        pg_bt, metrics = self._policy_loss_bt(logp, old, adv_bt, mask)
        metrics.update(_ratio_stats("ratio/", _token_ratio(logp, old), mask, Reduce.TOKEN_MEAN))
        kl_old = masked_mean(k3(old, logp.detach()), mask)
        metrics.add("policy/kl_old", kl_old, Reduce.TOKEN_MEAN, per_update=True)
        is_weight_bt = correction_weights(correction, old, rollout, mask, is_weight_mean)  # detached inside
        if is_weight_bt is not None:
            pg_bt = pg_bt * is_weight_bt
            metrics.add("mismatch/is_weight_mean", masked_mean(is_weight_bt, mask), Reduce.TOKEN_MEAN)
            metrics.update(correction_metrics(correction, old, rollout, mask, is_weight_mean))
        if rollout is not None:
            metrics.update(mismatch_metrics(old, rollout, mask))

        agg = functools.partial(
            aggregate,
            mask_bt=mask,
            mode=self.agg,
            num_sequences=num_sequences,
            num_tokens=num_tokens,
            max_len=self.max_len,
        )
        loss = agg(pg_bt)
        metrics.add("loss/pg", loss.detach(), Reduce.SUM)
        loss = loss + self._kl_term(logp, ref_logp_bt, mask, agg, metrics)
        loss = loss - self._entropy_term(entropy_bt, mask, agg, metrics)
        metrics.add("loss/total", loss.detach(), Reduce.SUM)
        return loss, metrics

    def _policy_loss_bt(
        self, logp_bt: torch.Tensor, old_logp_bt: torch.Tensor, adv_bt: torch.Tensor, mask_bt: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        raise NotImplementedError

    def _kl_term(self, logp_bt, ref_logp_bt, mask_bt, agg, metrics: Metrics) -> torch.Tensor:
        """``kl_coef · agg(k3)`` with k3 = exp(ref − logp) − (ref − logp) − 1; logs ``kl/k3_ref`` whenever ref is given."""
        if self.kl_coef > 0 and ref_logp_bt is None:
            raise ValueError(
                "kl_coef > 0 needs ref_logp_bt (reference-policy log-probs); pass it or set kl_coef=0"
            )
        if ref_logp_bt is None:
            return torch.zeros((), device=logp_bt.device)
        _check_shape("ref_logp_bt", ref_logp_bt, mask_bt)
        ref_bt = _valid(ref_logp_bt, mask_bt).detach()
        log_ref_ratio_bt = (ref_bt - logp_bt).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3_bt = log_ref_ratio_bt.exp() - log_ref_ratio_bt - 1.0  # Schulman's k3: unbiased, always >= 0
        metrics.add("kl/k3_ref", masked_mean(k3_bt.detach(), mask_bt), Reduce.TOKEN_MEAN)
        if self.kl_coef == 0:
            return torch.zeros((), device=logp_bt.device)
        term = self.kl_coef * agg(k3_bt)
        metrics.add("loss/kl", term.detach(), Reduce.SUM)
        return term

    def _entropy_term(self, entropy_bt, mask_bt, agg, metrics: Metrics) -> torch.Tensor:
        """``entropy_coef · agg(entropy)`` (the caller subtracts it); logs ``entropy`` whenever it is given."""
        if self.entropy_coef > 0 and entropy_bt is None:
            raise ValueError("entropy_coef > 0 needs entropy_bt; pass it or set entropy_coef=0")
        if entropy_bt is None:
            return torch.zeros((), device=mask_bt.device)
        entropy_bt = _optional_valid("entropy_bt", entropy_bt, mask_bt)  # keeps its graph: the bonus needs it
        metrics.add("entropy", masked_mean(entropy_bt.detach(), mask_bt), Reduce.TOKEN_MEAN)
        if self.entropy_coef == 0:
            return torch.zeros((), device=mask_bt.device)
        term = self.entropy_coef * agg(entropy_bt)
        metrics.add("loss/entropy_bonus", term.detach(), Reduce.SUM)
        return term


class SapoLoss(_PolicyLossBase):
    """SAPO, Soft Adaptive Policy Optimization (Qwen, arXiv:2511.20347).

    ``l_t = −f(r_t)·A_t`` with the soft gate ``f(r) = σ(τ(r−1))·4/τ``, ``τ = tau_pos`` if ``A > 0`` else
    ``tau_neg``. Its gradient wrt logp is ``w·r·A`` with ``w = sech²(τ(r−1)/2)``: 1 on-policy, decaying
    smoothly (≈ 4e^{−τ|r−1|}) but never to zero. ``level="sequence"`` gates the GSPO-token ratio
    ``sg[s_i]·π/sg[π]`` instead of ``r_t``, so token-level advantages still work.
    """

    name: Literal["sapo"] = "sapo"
    tau_pos: float = Field(1.0, gt=0)
    tau_neg: float = Field(1.05, gt=0)
    level: Literal["token", "sequence"] = "token"

    def _policy_loss_bt(self, logp_bt, old_logp_bt, adv_bt, mask_bt):
        metrics = MetricSet()
        if self.level == "token":
            ratio_bt = _token_ratio(logp_bt, old_logp_bt)
        else:
            seq_ratio_b = _sequence_ratio(logp_bt, old_logp_bt, mask_bt)
            ratio_bt = _gspo_token_ratio(seq_ratio_b, logp_bt)
            metrics.update(_ratio_stats("ratio/seq_", seq_ratio_b, mask_bt.any(-1), Reduce.SEQUENCE_MEAN))
        tau_bt = torch.where(adv_bt > 0, self.tau_pos, self.tau_neg)
        x_bt = tau_bt * (ratio_bt - 1.0)
        gate_bt = torch.sigmoid(x_bt.detach()) * 4.0 / tau_bt
        # sech²(x/2) = 4e^{-|x|}/(1+e^{-|x|})²: autograd through sigmoid would round w to exactly 0 for
        # x ≳ 17 in fp32; this form stays positive and accurate, as the paper's gradient says it should be.
        e_bt = torch.exp(-x_bt.detach().abs())
        w_bt = 4.0 * e_bt / (1.0 + e_bt) ** 2
        # Value f(r); gradient wrt logp = w·r (since d(r − sg[r]) = r·dlogp).
        f_bt = gate_bt + w_bt * (ratio_bt - ratio_bt.detach())
        metrics.update(_sapo_metrics(w_bt, adv_bt, mask_bt))
        return -f_bt * adv_bt, metrics


class GrpoLoss(_PolicyLossBase):
    """GRPO / DAPO PPO-clip surrogate (DeepSeekMath arXiv:2402.03300; DAPO clip-higher arXiv:2503.14476).

    ``l_t = −min(r_t·A, clip(r_t, 1−eps_low, 1+eps_high)·A)``; with ``dual_clip = c`` (Ye et al. 2020,
    arXiv:1912.09729) the loss of ``A < 0`` tokens is further capped at ``−c·A``.
    """

    name: Literal["grpo"] = "grpo"
    eps_low: float = Field(0.2, gt=0, lt=1)
    eps_high: float = Field(0.28, gt=0)
    dual_clip: float | None = Field(None, gt=1, description="c > 1; None disables dual-clip")

    def _policy_loss_bt(self, logp_bt, old_logp_bt, adv_bt, mask_bt):
        ratio_bt = _token_ratio(logp_bt, old_logp_bt)
        loss_bt, clipped = _clipped_surrogate(ratio_bt, adv_bt, self.eps_low, self.eps_high, self.dual_clip)
        clip = {f"clip/{k}": masked_mean(v, mask_bt) for k, v in clipped.items()}
        return loss_bt, metric_set(clip, Reduce.TOKEN_MEAN, per_update=True)


class GspoLoss(_PolicyLossBase):
    """GSPO, Group Sequence Policy Optimization (Qwen, arXiv:2507.18071).

    ``name="gspo"``: the clipped surrogate on the sequence ratio ``s_i = exp(mean_t(logp − old_logp))``;
    needs sequence-level advantages. ``name="gspo_token"``: ratio ``s_{i,t} = sg[s_i]·π_t/sg[π_t]`` (same value
    and, for sequence-level advantages, same gradient) which also accepts token-level advantages.
    """

    name: Literal["gspo", "gspo_token"] = "gspo"
    eps_low: float = Field(3e-4, gt=0, lt=1)
    eps_high: float = Field(4e-4, gt=0)

    def _policy_loss_bt(self, logp_bt, old_logp_bt, adv_bt, mask_bt):
        seq_ratio_b = _sequence_ratio(logp_bt, old_logp_bt, mask_bt)
        if self.name == "gspo":
            _require_sequence_advantages(adv_bt, mask_bt)
            ratio_bt = seq_ratio_b[:, None].expand_as(logp_bt)
        else:
            ratio_bt = _gspo_token_ratio(seq_ratio_b, logp_bt)
        loss_bt, clipped = _clipped_surrogate(ratio_bt, adv_bt, self.eps_low, self.eps_high)
        # GSPO clips whole sequences, so clip fractions count sequences (each weighted by its clipped-token share).
        clip = {f"clip/{k}": _sequence_mean(v, mask_bt) for k, v in clipped.items()}
        metrics = metric_set(clip, Reduce.SEQUENCE_MEAN, per_update=True)
        metrics.update(_ratio_stats("ratio/seq_", seq_ratio_b, mask_bt.any(-1), Reduce.SEQUENCE_MEAN))
        return loss_bt, metrics


# ---------------------------------------------------------------------------------------------- tensor helpers


def _token_ratio(logp_bt: torch.Tensor, old_logp_bt: torch.Tensor) -> torch.Tensor:
    return (logp_bt - old_logp_bt).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def _sequence_ratio(logp_bt: torch.Tensor, old_logp_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """GSPO ``s_i`` ``[batch]``: the length-normalised geometric mean of the token ratios (1 for empty rows)."""
    mean_b = _row_mean(logp_bt - old_logp_bt, mask_bt)
    return mean_b.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def _gspo_token_ratio(seq_ratio_b: torch.Tensor, logp_bt: torch.Tensor) -> torch.Tensor:
    """``sg[s_i]·π_t/sg[π_t]`` ``[batch, seq]``: value ``s_i``, gradient ``s_i·dlogp_t`` for each token alone."""
    return seq_ratio_b.detach()[:, None] * (logp_bt - logp_bt.detach()).exp()


def _clipped_surrogate(
    ratio_bt: torch.Tensor,
    adv_bt: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip loss ``[batch, seq]`` and float masks of the tokens where a clipped (zero-gradient) branch wins."""
    unclipped_bt = -ratio_bt * adv_bt
    clipped_bt = -ratio_bt.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_bt
    loss_bt = torch.maximum(unclipped_bt, clipped_bt)
    frac_high = (adv_bt > 0) & (ratio_bt > 1.0 + eps_high)
    frac_low = (adv_bt < 0) & (ratio_bt < 1.0 - eps_low)
    clipped = {
        "frac_low": frac_low.float(),
        "frac_high": frac_high.float(),
        "frac": (frac_low | frac_high).float(),
    }
    if dual_clip is not None:
        # For A < 0 a huge ratio would make -r·A unbounded; cap it at -c·A (the dual-clip branch).
        dual_bt = (adv_bt < 0) & (loss_bt > -dual_clip * adv_bt)
        loss_bt = torch.where(dual_bt, -dual_clip * adv_bt, loss_bt)
        clipped["frac_dual"] = dual_bt.float()
    return loss_bt, clipped


def k3(target_logp_bt: torch.Tensor, logp_bt: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(π ‖ target) per token, ``exp(d) − d − 1`` with ``d = target − logp``
    (clamped to ±20 before ``exp``): unbiased, never negative. ``policy/kl_old`` is ``k3(old_logp, logp)``."""
    d_bt = (target_logp_bt.float() - logp_bt.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return d_bt.exp() - d_bt - 1.0


def _sapo_metrics(w_bt: torch.Tensor, adv_bt: torch.Tensor, mask_bt: torch.Tensor) -> Metrics:
    """Gate means per advantage sign, the fraction of tokens gated below 0.5, and ``sapo/seq_w_std``: the gate's
    standard deviation within each sequence (population, over its response tokens), averaged over sequences – the
    paper's "sequence-coherent" gate reads near 0."""
    pos_bt, neg_bt = mask_bt & (adv_bt > 0), mask_bt & (adv_bt < 0)
    low_bt = (w_bt < 0.5).float()
    row_mean_b = _row_mean(w_bt, mask_bt)
    row_var_b = _row_mean((w_bt - row_mean_b[:, None]) ** 2, mask_bt)
    metrics = MetricSet()
    for name, value, reduce in (
        ("sapo/seq_w_std", masked_mean(row_var_b.sqrt(), mask_bt.any(-1)), Reduce.SEQUENCE_MEAN),
        ("sapo/w_mean", masked_mean(w_bt, mask_bt), Reduce.TOKEN_MEAN),
        ("sapo/w_mean_pos", masked_mean(w_bt, pos_bt), Reduce.POS_TOKEN_MEAN),
        ("sapo/w_mean_neg", masked_mean(w_bt, neg_bt), Reduce.NEG_TOKEN_MEAN),
        ("sapo/frac_w_lt_half_pos", masked_mean(low_bt, pos_bt), Reduce.POS_TOKEN_MEAN),
        ("sapo/frac_w_lt_half_neg", masked_mean(low_bt, neg_bt), Reduce.NEG_TOKEN_MEAN),
    ):
        metrics.add(name, value, reduce, per_update=True)  # the gate's diagnostics, also per update
    return metrics


def _ratio_stats(prefix: str, ratio: torch.Tensor, mask: torch.Tensor, mean: Reduce) -> Metrics:
    """min/mean/max of ``ratio`` over ``mask`` (same shape); 1 when nothing is valid. ``mean``: how the mean
    pools (over tokens or over sequences)."""
    ratio, any_valid = ratio.detach(), mask.any()
    stats = {
        "min": torch.where(mask, ratio, torch.inf).amin(),
        "mean": masked_mean(ratio, mask),
        "max": torch.where(mask, ratio, -torch.inf).amax(),
    }
    metrics = MetricSet()
    for name, reduce in (("min", Reduce.MIN), ("mean", mean), ("max", Reduce.MAX)):
        # the token ratio's mean is a per-update diagnostic too
        per_update = prefix == "ratio/" and name == "mean"
        metrics.add(
            f"{prefix}{name}", torch.where(any_valid, stats[name], 1.0), reduce, per_update=per_update
        )
    return metrics


def _row_mean(x_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """``[batch]`` mean of ``x_bt`` over each row's valid tokens (0 for empty rows)."""
    return torch.where(mask_bt, x_bt, 0.0).sum(-1) / mask_bt.sum(-1).clamp(min=1)


def _sequence_mean(x_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """Mean over sequences with a valid token of each sequence's masked token mean."""
    return masked_mean(_row_mean(x_bt, mask_bt), mask_bt.any(-1))


def _require_sequence_advantages(adv_bt: torch.Tensor, mask_bt: torch.Tensor, name: str = "gspo") -> None:
    if adv_bt.numel() == 0:
        return
    adv_b = _row_mean(adv_bt, mask_bt)
    spread = torch.where(mask_bt, (adv_bt - adv_b[:, None]).abs(), 0.0).amax()
    if spread > 1e-6 + 1e-5 * adv_b.abs().max():
        raise ValueError(
            f"{name} needs sequence-level advantages; use gspo_token or sapo "
            f"(advantages vary within a sequence by up to {float(spread):.3g})"
        )


def _broadcast_adv(adv: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    if adv.dim() == 1 and adv.shape[0] == mask_bt.shape[0]:
        return adv[:, None].expand(mask_bt.shape)
    _check_shape("adv", adv, mask_bt)
    return adv


def _valid(x_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    # where (not a product) keeps nan/inf on padded tokens out of both the value and the gradient.
    return torch.where(mask_bt, x_bt.float(), 0.0)


def _optional_valid(name: str, x_bt: torch.Tensor | None, mask_bt: torch.Tensor) -> torch.Tensor | None:
    if x_bt is None:
        return None
    _check_shape(name, x_bt, mask_bt)
    return _valid(x_bt, mask_bt)


def _check_shape(name: str, x: torch.Tensor, mask_bt: torch.Tensor) -> None:
    if x.shape != mask_bt.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(mask_bt.shape)} like mask_bt")
