"""Every accepted setting changes the result, checked against a hand value."""

from __future__ import annotations

import math

import pytest
import torch

from sapo_megatron.algo import TIS, GrpoLoss, GspoLoss, IcePop, NoCorrection, SapoLoss, policy_loss
from tests.algo.reference import MAX_LEN, clip_ref, make_batch, sapo_ref


def one_token(r, a, **settings):
    loss, _ = policy_loss(settings.pop("name"), *make_batch([[r]], [[1]], [a]), **settings)
    return loss.item()


@pytest.mark.parametrize("tau_pos", [0.5, 1.0, 3.0])
def test_tau_pos(tau_pos):
    assert one_token(1.4, 2.0, name="sapo", tau_pos=tau_pos) == pytest.approx(
        sapo_ref(1.4, 2.0, tau_pos=tau_pos), rel=1e-6
    )
    # tau_pos does not touch negative advantages
    assert one_token(1.4, -2.0, name="sapo", tau_pos=tau_pos) == pytest.approx(sapo_ref(1.4, -2.0), rel=1e-6)
    assert one_token(1.4, 2.0, name="sapo", tau_pos=0.5) != pytest.approx(
        one_token(1.4, 2.0, name="sapo", tau_pos=3.0)
    )


@pytest.mark.parametrize("tau_neg", [0.95, 1.05, 2.0])
def test_tau_neg(tau_neg):
    assert one_token(1.4, -2.0, name="sapo", tau_neg=tau_neg) == pytest.approx(
        sapo_ref(1.4, -2.0, tau_neg=tau_neg), rel=1e-6
    )
    assert one_token(1.4, 2.0, name="sapo", tau_neg=tau_neg) == pytest.approx(sapo_ref(1.4, 2.0), rel=1e-6)
    assert one_token(1.4, -2.0, name="sapo", tau_neg=0.95) != pytest.approx(
        one_token(1.4, -2.0, name="sapo", tau_neg=2.0)
    )


def test_level():
    batch = make_batch([[2.0, 0.5]], [[1, 1]], [1.0])
    token, _ = SapoLoss(level="token").compute(*batch)
    sequence, _ = SapoLoss(level="sequence").compute(*batch)
    assert token.item() == pytest.approx((sapo_ref(2.0, 1.0) + sapo_ref(0.5, 1.0)) / 2, rel=1e-6)
    assert sequence.item() == pytest.approx(sapo_ref(1.0, 1.0), rel=1e-6)  # s = sqrt(2 · 0.5) = 1


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_eps_low(name):
    for eps_low in (0.1, 0.4):
        expected = clip_ref(0.7, -1.0, eps_low, 0.28)
        assert one_token(0.7, -1.0, name=name, eps_low=eps_low, eps_high=0.28) == pytest.approx(
            expected, rel=1e-6
        )
    assert clip_ref(0.7, -1.0, 0.1, 0.28) != clip_ref(0.7, -1.0, 0.4, 0.28)


@pytest.mark.parametrize("name", ["grpo", "gspo_token"])
def test_eps_high(name):
    for eps_high in (0.1, 0.4):
        expected = clip_ref(1.3, 1.0, 0.2, eps_high)
        assert one_token(1.3, 1.0, name=name, eps_low=0.2, eps_high=eps_high) == pytest.approx(
            expected, rel=1e-6
        )
    assert clip_ref(1.3, 1.0, 0.2, 0.1) != clip_ref(1.3, 1.0, 0.2, 0.4)


def test_dual_clip():
    # A = -0.5, r = 5: PPO loss max(2.5, 0.64) = 2.5; dual-clip c=3 caps it at -c·A = 1.5.
    assert one_token(5.0, -0.5, name="grpo") == pytest.approx(2.5, rel=1e-6)
    assert one_token(5.0, -0.5, name="grpo", dual_clip=3.0) == pytest.approx(1.5, rel=1e-6)
    assert one_token(5.0, 0.5, name="grpo", dual_clip=3.0) == pytest.approx(-0.64, rel=1e-6)  # A>0 untouched
    assert one_token(2.0, -0.5, name="grpo", dual_clip=3.0) == pytest.approx(1.0, rel=1e-6)  # below c


def test_agg_and_max_len():
    batch = make_batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [[1, 1, 1], [1, 0, 0]], [1.0, 1.0])
    results = {
        agg: GrpoLoss(agg=agg, max_len=MAX_LEN).compute(*batch)[0].item()
        for agg in ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
    }
    assert results == pytest.approx(
        {
            "seq-mean-token-mean": -1.0,
            "token-mean": -1.0,
            "seq-mean-token-sum-norm": -4.0 / (2 * MAX_LEN),
        }
    )
    batch = make_batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [[1, 1, 1], [1, 0, 0]], [1.0, 3.0])
    smtm = GrpoLoss(agg="seq-mean-token-mean").compute(*batch)[0].item()
    token_mean = GrpoLoss(agg="token-mean").compute(*batch)[0].item()
    assert (smtm, token_mean) == pytest.approx((-(1 + 3) / 2, -(3 + 3) / 4))
    short = GrpoLoss(agg="seq-mean-token-sum-norm", max_len=3).compute(*batch)[0].item()
    long = GrpoLoss(agg="seq-mean-token-sum-norm", max_len=6).compute(*batch)[0].item()
    assert (short, long) == pytest.approx((-6 / 6, -6 / 12))


def test_kl_coef():
    logp, old, adv, mask = make_batch([[1.0, 1.0]], [[1, 1]], [0.0])
    ref = logp.detach() + torch.tensor([[0.5, -1.0]])
    k3 = [math.exp(0.5) - 0.5 - 1, math.exp(-1.0) + 1.0 - 1]
    for coef in (0.0, 0.1, 1.0):
        loss, metrics = GrpoLoss(kl_coef=coef).compute(logp, old, adv, mask, ref_logp_bt=ref)
        assert loss.item() == pytest.approx(coef * sum(k3) / 2, rel=1e-6)
        assert metrics["kl/k3_ref"].item() == pytest.approx(sum(k3) / 2, rel=1e-6)
    # gradient of k3 wrt logp: 1 - exp(ref - logp)
    loss, _ = GrpoLoss(kl_coef=1.0).compute(logp, old, adv, mask, ref_logp_bt=ref)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[1 - math.exp(0.5), 1 - math.exp(-1.0)]]) / 2)


def test_entropy_coef():
    logp, old, adv, mask = make_batch([[1.0, 1.0, 1.0]], [[1, 1, 0]], [0.0])
    entropy = torch.tensor([[0.8, 0.4, 100.0]], requires_grad=True)
    for coef in (0.0, 0.01, 0.5):
        loss, metrics = SapoLoss(entropy_coef=coef).compute(logp, old, adv, mask, entropy_bt=entropy)
        assert loss.item() == pytest.approx(-coef * (0.8 + 0.4) / 2, rel=1e-6)
        assert metrics["entropy"].item() == pytest.approx(0.6, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, entropy)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -0.25, 0.0]]))


def with_correction(correction, delta):
    """One token, r=1, A=1 (GRPO per-token loss -1); rollout_logp = old_logp - delta."""
    logp, old, adv, mask = make_batch([[1.0]], [[1]], [1.0])
    loss, metrics = GrpoLoss().compute(
        logp, old, adv, mask, rollout_logp_bt=old - delta, correction=correction
    )
    return loss.item(), metrics


@pytest.mark.parametrize("cap", [2.0, 5.0])
def test_tis_cap(cap):
    assert with_correction(TIS(cap=cap), math.log(3.0))[0] == pytest.approx(-min(3.0, cap), rel=1e-6)
    assert with_correction(TIS(cap=cap), math.log(0.4))[0] == pytest.approx(-0.4, rel=1e-6)  # no lower bound


def test_tis_weight_is_detached():
    logp, old, adv, mask = make_batch([[1.0]], [[1]], [1.0])
    loss, _ = GrpoLoss().compute(logp, old, adv, mask, rollout_logp_bt=old - math.log(1.5), correction=TIS())
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.item() == pytest.approx(-1.5, rel=1e-6)  # weight × plain gradient, nothing through the weight


@pytest.mark.parametrize(("low", "high"), [(0.5, 2.0), (0.2, 5.0)])
def test_icepop_band(low, high):
    for ratio in (0.3, 0.6, 1.7, 3.0):
        expected = -ratio if low <= ratio <= high else 0.0
        assert with_correction(IcePop(low=low, high=high), math.log(ratio))[0] == pytest.approx(
            expected, abs=1e-6
        )


def test_no_correction_is_identity_and_metrics_still_logged():
    loss, metrics = with_correction(NoCorrection(), math.log(3.0))
    assert loss == pytest.approx(-1.0)
    assert metrics["mismatch/frac_ratio_gt_2"].item() == 1.0
    assert "mismatch/is_weight_mean" not in metrics


def test_gspo_settings_are_its_own():
    assert GspoLoss().eps_low == 3e-4 and GspoLoss().eps_high == 4e-4
    assert GrpoLoss().eps_low == 0.2 and GrpoLoss().eps_high == 0.28
    assert (SapoLoss().tau_pos, SapoLoss().tau_neg, SapoLoss().agg) == (1.0, 1.05, "seq-mean-token-mean")
