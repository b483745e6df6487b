"""CISPO, GMPO, DPPO and M2PO against independent references of their anchors' formulas: value and gradient
wrt the current log-probs on the same tensors, ≤ 1e-6 (the references run in float64, ours in float32).

Anchors read for these references (formulas rewritten here element by element, not copied):
- CISPO: huggingface/trl@f2cd57710ae345ea6428ae95363267fcf38a3dc8 ``trl/trainer/grpo_trainer.py``
  (``loss_type="cispo"``: ``−min(r, ε_high).detach()·A·logp``, token-mean) and
  volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7 ``verl/trainer/ppo/core_algos.py``
  ``compute_policy_loss_cispo`` (``−clamp(r, 1−ε_low, 1+ε_high).detach()·A·logp``).
- GMPO: volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7 ``compute_policy_loss_geo_mean``
  (log-ratio clipped by advantage sign, geometric mean per sequence, ``torch.mean`` over rows).
- DPPO: the authors' sail-sg/Stable-RL@c6af1d119c0fe30d16dd9a837d35fdf695acd226 ``core_algos.py``
  ``compute_policy_loss_with_mask`` / ``_compute_token_mask_for_policy_loss`` (binary TV / KL, run in their
  recommended bypass mode where the rollout log-probs are the old ones) and verl's port as in
  wwj-git-rgb/verl@1dda039b9c6311889a9c9a26040677e1254814f9 ``compute_policy_loss_dppo_tv`` / ``_dppo_kl``.
- M2PO: inclusionAI/AReaL@4aef98d8d818af55b43621aaadba047ae10f4e77 ``areal/trainer/ppo/actor.py``
  ``_apply_m2po_masking`` / ``_get_m2po_loss_mask`` and ``areal/utils/functional/functional.py``
  ``ppo_actor_loss_fn`` (token ratio, sum over kept tokens / kept count).
"""

from __future__ import annotations

import math

import pytest
import torch

from sapo_megatron.algo import CispoLoss, DppoLoss, GmpoLoss, M2poLoss, m2po_keep_mask

TOL = 1e-6
WORST: dict[str, float] = {}


def _batch(seed: int = 0, *, empty_row: bool = True):
    """6 sequences × 9 tokens of probabilities in (0.02, 0.98), log-ratios ~N(0, 0.6²) (ratios ~0.2..5),
    right padding with NaN, per-sequence advantages of both signs and one zero."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.empty(6, 9, dtype=torch.float64).uniform_(0.02, 0.98, generator=gen).log()
    logp = old + 0.6 * torch.randn(6, 9, generator=gen, dtype=torch.float64)
    logp = torch.minimum(logp, torch.tensor(-0.01, dtype=torch.float64))  # still a log-probability
    lengths = torch.tensor([9, 7, 0 if empty_row else 3, 5, 9, 2])
    mask = torch.arange(9)[None, :] < lengths[:, None]
    adv = torch.tensor([1.3, -0.7, 0.4, 0.0, -1.6, 2.1], dtype=torch.float64)
    rollout = old + 0.25 * torch.randn(6, 9, generator=gen, dtype=torch.float64)
    for t in (old, rollout):
        t[~mask] = float("nan")
    return logp, old, adv, mask, rollout


def _ours(loss_fn, logp, old, adv, mask, **kwargs):
    logp32 = logp.float().requires_grad_()
    loss, metrics = loss_fn.compute(logp32, old.float(), adv.float(), mask, **kwargs)
    (grad,) = torch.autograd.grad(loss, logp32)
    return loss.double(), grad.double(), metrics


def _reference(per_token_loss, logp, mask, agg):
    """Value and gradient of the anchor's per-token loss (a function of the float64 log-probs) under ``agg``."""
    x = logp.detach().clone().requires_grad_()
    loss_bt = torch.where(mask, per_token_loss(x), 0.0)
    m = mask.double()
    if agg == "token-mean":
        value = loss_bt.sum() / m.sum()
    elif agg == "seq-mean-token-mean":
        rows = m.sum(-1) > 0
        value = (loss_bt.sum(-1)[rows] / m.sum(-1)[rows]).mean()
    else:
        raise AssertionError(agg)
    (grad,) = torch.autograd.grad(value, x)
    return value, grad


def _assert_equal(label, ours, ref):
    (value, grad), (ref_value, ref_grad) = ours[:2], ref
    worst = max(abs(value.item() - ref_value.item()), (grad - ref_grad).abs().max().item())
    WORST[label] = max(WORST.get(label, 0.0), worst)
    assert worst <= TOL, f"{label}: deviation {worst:.3g}"
    assert grad.abs().max() > 1e-3  # not vacuous


def _bcast(adv, mask):
    return adv[:, None].expand(mask.shape)


# ---------------------------------------------------------------------------------------------- CISPO


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_cispo_equals_trl(seed, agg):
    logp, old, adv, mask, _ = _batch(seed)
    eps_high = 1.5  # small enough that some weights are capped on this batch

    def trl(x):  # TRL: clamped_ratios = clamp(coef_1, max=epsilon_high).detach(); −w·A·logp
        w = torch.exp(x - old).clamp(max=eps_high).detach()
        return -w * _bcast(adv, mask) * x

    ours = _ours(CispoLoss(max_ratio=eps_high, agg=agg), logp, old, adv, mask)
    _assert_equal("cispo/trl", ours, _reference(trl, logp, mask, agg))
    assert ours[2]["clip/frac_high"] > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_cispo_equals_verl(seed):
    logp, old, adv, mask, _ = _batch(seed)
    low, high = 0.2, 0.28

    def verl(x):  # verl: clamp(ratio, 1 − low, 1 + high).detach(), log-ratio clamped to ±20
        w = torch.exp((x - old).clamp(-20, 20)).clamp(1 - low, 1 + high).detach()
        return -w * _bcast(adv, mask) * x

    loss_fn = CispoLoss(min_ratio=1 - low, max_ratio=1 + high)
    ours = _ours(loss_fn, logp, old, adv, mask)
    _assert_equal("cispo/verl", ours, _reference(verl, logp, mask, "token-mean"))
    assert ours[2]["clip/frac_low"] > 0 and ours[2]["clip/frac_high"] > 0


def test_cispo_gradient_is_the_capped_weight_times_the_policy_gradient():
    logp, old, adv, mask, _ = _batch(3)
    _, grad, _ = _ours(CispoLoss(), logp, old, adv, mask)
    w = torch.exp(logp - old).clamp(max=5.0)
    expected = torch.where(mask, -w * _bcast(adv, mask) / mask.sum(), 0.0)
    torch.testing.assert_close(grad, expected, atol=1e-7, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- GMPO


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip", [(0.4, 0.4), (0.1, 0.2)])
def test_gmpo_equals_verl_geo_mean(seed, clip):
    logp, old, adv, mask, _ = _batch(seed, empty_row=False)  # verl's torch.mean counts empty rows too
    low, high = clip
    m = mask.double()

    def verl_sequence_loss(x):
        d = x - old
        sgn = torch.sign(_bcast(adv, mask))
        d_min = sgn * torch.minimum(sgn * d, sgn * d.clamp(-low, high))
        d_min = torch.where(mask, d_min, 0.0)
        ratio_b = torch.exp(d_min.sum(-1) / (m.sum(-1) + 1e-8))
        return -adv * ratio_b  # [batch]

    x = logp.detach().clone().requires_grad_()
    ref_value = verl_sequence_loss(x).mean()
    (ref_grad,) = torch.autograd.grad(ref_value, x)
    ours = _ours(GmpoLoss(clip_low=low, clip_high=high), logp, old, adv, mask)
    # verl's 1e-8 in the length divisor changes the result by ~1e-9 relative: inside the tolerance.
    _assert_equal("gmpo/verl", ours, (ref_value, ref_grad))
    assert ours[2]["clip/frac"] > 0


def test_gmpo_refuses_token_level_advantages_and_other_aggregations():
    logp, old, _, mask, _ = _batch(0)
    with pytest.raises(ValueError, match="gmpo needs sequence-level advantages"):
        GmpoLoss().compute(logp.float(), old.float(), torch.randn(6, 9), mask)
    with pytest.raises(ValueError, match="undefined for it; use agg: seq-mean-token-mean"):
        GmpoLoss(agg="token-mean")


# ---------------------------------------------------------------------------------------------- DPPO


def _stable_rl_valid(x, rollout, adv, mode, low, high):
    """Stable-RL's ``_compute_token_mask_for_policy_loss`` (``dppo_binary_tv`` / ``dppo_binary_kl``), the trust
    region measured against the rollout policy (= old in bypass mode)."""
    p, p_roll = x.exp(), rollout.exp()
    if mode == "tv":
        invalid_pos, invalid_neg = (p - p_roll) > high, (p - p_roll) < -low
    else:
        kl = p_roll * (rollout - x) + (1 - p_roll) * torch.log((1.0 - p_roll + 1e-8) / (1.0 - p + 1e-8))
        invalid_pos, invalid_neg = (kl > high) & (p > p_roll), (kl > low) & (p < p_roll)
    invalid = torch.where(_bcast(adv, rollout.isfinite()) > 0, invalid_pos, invalid_neg)
    return 1.0 - invalid.double().detach()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", ["tv", "kl"])
@pytest.mark.parametrize("cap", [None, 1.5])
def test_dppo_equals_stable_rl_in_bypass_mode(seed, mode, cap):
    logp, old, adv, mask, _ = _batch(seed)
    delta = 0.15 if mode == "tv" else 0.05

    def stable_rl(x):  # −A·sg[min(π/μ, c)]·M·logp with μ = old (bypass)
        ratio = torch.exp((x - old).clamp(max=20.0))
        if cap is not None:
            ratio = ratio.clamp(max=cap)
        valid = _stable_rl_valid(x.detach(), old, adv, mode, delta, delta)
        return -_bcast(adv, mask) * ratio.detach() * valid * x

    ours = _ours(DppoLoss(name=f"dppo_{mode}", ratio_cap=cap), logp, old, adv, mask)
    _assert_equal(f"dppo_{mode}/stable-rl", ours, _reference(stable_rl, logp, mask, "token-mean"))
    assert 0 < ours[2]["clip/frac"] < 1


@pytest.mark.parametrize("mode", ["tv", "kl"])
def test_dppo_equals_verl_port(mode):
    logp, old, adv, mask, _ = _batch(4)
    low, high, cap = (0.1, 0.2, 1.5) if mode == "tv" else (0.03, 0.08, 1.5)

    def verl(x):
        ratio = torch.exp((x - old).clamp(-20, 20)).clamp(max=cap).detach()
        p, p_old = x.detach().exp(), old.exp()
        a = _bcast(adv, mask)
        if mode == "tv":
            valid = torch.where(a > 0, (p - p_old) <= high, (p - p_old) >= -low)
        else:
            kl = p_old * (old - x.detach()) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
            valid = torch.where(a > 0, (kl <= high) | (p <= p_old), (kl <= low) | (p >= p_old))
        return -a * ratio * x * valid.double()

    loss_fn = DppoLoss(name=f"dppo_{mode}", delta_low=low, delta_high=high, ratio_cap=cap)
    ours = _ours(loss_fn, logp, old, adv, mask)
    _assert_equal(f"dppo_{mode}/verl", ours, _reference(verl, logp, mask, "token-mean"))
    assert ours[2]["dppo/frac_ratio_capped"] > 0


def test_dppo_defaults_are_the_authors():
    assert (DppoLoss().delta_low, DppoLoss().delta_high) == (0.15, 0.15)
    kl = DppoLoss(name="dppo_kl")
    assert (kl.delta_low, kl.delta_high, kl.ratio_cap) == (0.05, 0.05, None)


# ---------------------------------------------------------------------------------------------- M2PO


def _areal_keep(old, rollout, mask, threshold):
    """AReaL's rule written as a loop: drop the k largest M2 for the smallest k whose remaining mean is below the
    threshold (all but one if none is)."""
    values = [((o - r) ** 2).item() for o, r, m in zip(old.flatten(), rollout.flatten(), mask.flatten()) if m]
    order = sorted(range(len(values)), key=lambda i: -values[i])
    k = next(
        (k for k in range(len(values)) if sum(values[i] for i in order[k:]) / (len(values) - k) < threshold),
        len(values) - 1,
    )
    dropped = set(order[:k])
    keep = torch.zeros_like(mask)
    keep[mask] = torch.tensor([i not in dropped for i in range(len(values))])
    return keep


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("threshold", [0.04, 0.01])
def test_m2po_equals_areal(seed, threshold):
    logp, old, adv, mask, rollout = _batch(seed)
    keep = _areal_keep(old, rollout, mask, threshold)
    assert torch.equal(m2po_keep_mask(old, rollout, mask, threshold), keep)
    assert 0 < (mask & ~keep).sum() < mask.sum()

    def areal(x):  # eps_clip off: −A·π/π_prox over the kept tokens; the kept count divides
        return -_bcast(adv, mask) * torch.exp(x - old)

    loss_fn = M2poLoss(m2_threshold=threshold)
    ours = _ours(loss_fn, logp, old, adv, mask, rollout_logp_bt=rollout.float())
    _assert_equal("m2po/areal", ours, _reference(areal, logp, keep, "token-mean"))
    dropped = ((mask & ~keep).sum() / mask.sum()).item()
    assert ours[2]["m2po/frac_masked"].item() == pytest.approx(dropped, rel=1e-6)
    assert ours[2]["m2po/m2_mean_kept"] < threshold
    k3_all = torch.where(mask, torch.exp(old - rollout) - (old - rollout) - 1, 0.0).sum() / mask.sum()
    assert ours[2]["mismatch/k3"].item() == pytest.approx(
        k3_all.item(), rel=1e-5
    )  # every token, not the kept


def test_m2po_refuses_without_rollout_log_probs():
    logp, old, adv, mask, _ = _batch(0)
    with pytest.raises(ValueError, match="m2po needs rollout_logp_bt"):
        M2poLoss().compute(logp.float(), old.float(), adv.float(), mask)


def test_report_worst_deviations():
    """Prints the worst deviation per anchor (run with -s); runs last in this file."""
    assert WORST, "run the whole file"
    for label, worst in sorted(WORST.items()):
        print(f"{label}: worst |Δ| {worst:.2e}")
    assert max(WORST.values()) <= TOL and all(math.isfinite(w) for w in WORST.values())
