"""The decoupled objective (algo/decoupled.py) against an independent reference written from AReaL's source
(``areal/utils/functional/functional.py``: ``ppo_actor_loss_fn`` with ``proximal_logprobs`` and rejection
sampling in ``clamp`` mode (truncation, TIS) or ``mask`` mode (IcePop's band); ``compute_prox_logp_approximations``'s
``loglinear`` method with ``v_proximal = current_version - 1``), value and gradient to 1e-6; and the staleness
metrics on hand-counted numbers."""

from __future__ import annotations

import pytest
import torch

from sapo_megatron.algo import TIS, GrpoLoss, IcePop, NoCorrection, SapoLoss
from sapo_megatron.algo.decoupled import decoupled_loss, loglinear_proximal_logp, staleness_metrics

B, S = 4, 7


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(B, S, generator=g, dtype=torch.float64) * 2 - 0.05
    proximal = behaviour + 0.6 * torch.randn(B, S, generator=g, dtype=torch.float64)
    current = proximal + 0.25 * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, S, generator=g) > 0.25
    mask[:, 0] = True
    return behaviour.float(), proximal.float(), current.float(), adv.float(), mask


def _areal_reference(logp, prox, behav, adv_b, mask, *, eps_low, eps_high, weight_mode, low=None, high=None):
    """AReaL's ppo_actor_loss_fn (token level), written independently: ratio π_θ/π_prox, PPO clip, times the
    behaviour weight exp(prox − behav) truncated (clamp) or banded (mask), loss summed over valid tokens and
    divided by their original count."""
    adv = adv_b[:, None].expand_as(logp)
    w = torch.exp(prox - behav)
    if weight_mode == "clamp":
        w = w.clamp(max=high)
        keep = mask
    else:
        keep = mask & (w >= low) & (w <= high)
    w = torch.where(keep, w, torch.zeros_like(w))
    ratio = torch.where(mask, torch.exp(logp - prox), torch.zeros_like(logp))
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped) * w
    return torch.where(keep, pg, torch.zeros_like(pg)).sum() / mask.sum()


def _sapo_reference(logp, prox, behav, adv_b, mask, *, tau_pos, tau_neg, cap):
    """SAPO's gate on π_θ/π_prox (autograd through the sigmoid), times min(π_prox/π_b, cap); token mean."""
    adv = adv_b[:, None].expand_as(logp)
    ratio = torch.exp(logp - prox)
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    w = torch.exp(prox - behav).clamp(max=cap)
    pg = -gate * adv * w
    return torch.where(mask, pg, torch.zeros_like(pg)).sum() / mask.sum()


def _value_and_grad(fn, current):
    logp = current.clone().requires_grad_(True)
    value = fn(logp)
    (grad,) = torch.autograd.grad(value, logp)
    return float(value.detach()), grad


@pytest.mark.parametrize(
    ("correction", "mode", "band"),
    [(TIS(cap=1.5), "clamp", (None, 1.5)), (IcePop(low=0.6, high=1.8), "mask", (0.6, 1.8))],
)
def test_grpo_decoupled_equals_areal_reference(correction, mode, band):
    behaviour, proximal, current, adv, mask = _inputs(1)
    loss = GrpoLoss(eps_low=0.2, eps_high=0.28, agg="token-mean")
    ours, ours_grad = _value_and_grad(
        lambda lp: decoupled_loss(loss, lp, proximal, behaviour, adv, mask, correction=correction)[0], current
    )
    ref, ref_grad = _value_and_grad(
        lambda lp: _areal_reference(
            lp,
            proximal,
            behaviour,
            adv,
            mask,
            eps_low=0.2,
            eps_high=0.28,
            weight_mode=mode,
            low=band[0],
            high=band[1],
        ),
        current,
    )
    assert ours == pytest.approx(ref, abs=1e-6)
    assert torch.allclose(ours_grad, ref_grad, atol=1e-6)
    weights = torch.exp(proximal - behaviour)[mask]
    assert (weights > 1.5).any() and (weights < 0.6).any()  # both truncation and the band act on these tokens
    assert abs(ref) > 1e-3


def test_sapo_decoupled_gate_sees_current_over_proximal():
    behaviour, proximal, current, adv, mask = _inputs(2)
    loss = SapoLoss(tau_pos=1.0, tau_neg=1.05, agg="token-mean")
    ours, ours_grad = _value_and_grad(
        lambda lp: decoupled_loss(loss, lp, proximal, behaviour, adv, mask, correction=TIS(cap=2.0))[0],
        current,
    )
    ref, ref_grad = _value_and_grad(
        lambda lp: _sapo_reference(lp, proximal, behaviour, adv, mask, tau_pos=1.0, tau_neg=1.05, cap=2.0),
        current,
    )
    assert ours == pytest.approx(ref, abs=1e-6)
    assert torch.allclose(ours_grad, ref_grad, atol=1e-6)
    # Behaviour as the ratio's denominator (no decoupling) gives another loss: the pairing matters.
    coupled = float(loss.compute(current, behaviour, adv, mask, correction=NoCorrection())[0])
    assert abs(coupled - ours) > 1e-3


def _areal_loglinear(behav, logp, versions, current_version):
    v_prox = current_version - 1
    v_b = versions.float()
    diff = current_version - v_b
    alpha = torch.where((diff > 0) & (versions >= 0), (v_prox - v_b) / diff, torch.zeros_like(v_b)).clamp(
        0, 1
    )
    return behav + alpha * (logp - behav)


def test_loglinear_proximal_equals_areal_interpolation():
    behaviour, _, current, _, _ = _inputs(3)
    trainer_version = (
        7  # the proximal policy's version; the current policy counts as 8 (AReaL's current_version)
    )
    versions = torch.tensor([[7, 6, 5, 3, 7, 4, 2]] * B)
    ours = loglinear_proximal_logp(behaviour, current, trainer_version - versions)
    ref = _areal_loglinear(behaviour, current, versions, trainer_version + 1)
    assert torch.allclose(ours, ref, atol=1e-6)
    assert torch.equal(ours[:, 0], behaviour[:, 0])  # on-policy token: π_prox = π_b
    # staleness 4 (version 3): alpha = 4/5
    assert torch.allclose(ours[:, 3], behaviour[:, 3] + 0.8 * (current[:, 3] - behaviour[:, 3]), atol=1e-6)
    assert not ours.requires_grad


def test_staleness_metrics_count_tokens_and_samples():
    metrics = staleness_metrics([[0, 0, 1], [2, 2], [5]], buckets=2)
    assert metrics["staleness/token_mean"] == pytest.approx(10 / 6)
    assert metrics["staleness/token_max"] == 5
    assert metrics["staleness/sample_mean"] == pytest.approx((1 + 2 + 5) / 3)
    assert metrics["staleness/sample_max"] == 5
    shares = [metrics[f"staleness/tokens_{k}"] for k in range(3)]
    assert shares == pytest.approx([2 / 6, 1 / 6, 3 / 6])  # the last bucket holds 2 and 5
    assert staleness_metrics([], buckets=2) == {}
