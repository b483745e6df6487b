"""Gradient facts from the papers (ALGORITHMS.md), checked with autograd against hand formulas."""

from __future__ import annotations

import math

import pytest
import torch

from sapo_megatron.algo import GrpoLoss, GspoLoss, SapoLoss
from tests.algo.reference import ADV, MASK, MODES, RATIOS, make_batch, sech2, valid_rows

NUM_VALID_SEQS = 3  # rows 0, 1, 3 of MASK
NUM_VALID_TOKENS = 8


def grad_of(loss_fn, logp, old, adv, mask):
    loss, _ = loss_fn.compute(logp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    return grad


def agg_weight(i, mode):
    """d aggregate / d l_{i,t} for a valid token of row i of MASK."""
    if mode == "token-mean":
        return 1.0 / NUM_VALID_TOKENS
    return 1.0 / (NUM_VALID_SEQS * max(sum(MASK[i]), 1))


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_sapo_gradient_is_w_r_a(mode):
    tau_pos, tau_neg = 1.0, 1.05
    grad = grad_of(SapoLoss(agg=mode), *make_batch())
    for i, (r_row, a) in enumerate(zip(RATIOS, ADV)):
        tau = tau_pos if a > 0 else tau_neg
        for t, r in enumerate(r_row):
            expected = -sech2(tau * (r - 1) / 2) * r * a * agg_weight(i, mode) if MASK[i][t] else 0.0
            assert grad[i, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-9), (i, t)


@pytest.mark.parametrize("tau", [0.3, 1.0, 1.05, 2.0, 10.0])
def test_sapo_on_policy_gradient_equals_policy_gradient(tau):
    logp, _, adv, mask = make_batch()
    old = logp.detach()
    sapo_grad = grad_of(SapoLoss(tau_pos=tau, tau_neg=tau), logp, old, adv, mask)
    # Plain policy gradient with the same seq-mean-token-mean weights: loss = -Σ A·logp·weight.
    weight = torch.tensor(
        [[agg_weight(i, "seq-mean-token-mean") * m for m in row] for i, row in enumerate(MASK)]
    )
    (pg_grad,) = torch.autograd.grad(-(adv[:, None] * logp * weight).sum(), logp)
    torch.testing.assert_close(sapo_grad, pg_grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("r", [3.0, 10.0, 30.0, 60.0])
def test_sapo_gate_never_zero_and_decays_exponentially(r):
    ratios, mask, adv = [[r]], [[1]], [1.0]
    grad = grad_of(SapoLoss(), *make_batch(ratios, mask, adv))
    w = -grad.item() / r  # G = |y| = 1, so weight 1
    assert w > 0.0
    assert w == pytest.approx(sech2((r - 1) / 2), rel=1e-4)
    if r >= 10:  # 4e^{-x}/(1+e^{-x})² ≈ 4e^{-x} once e^{-x} is negligible
        assert w == pytest.approx(4 * math.exp(-(r - 1)), rel=1e-3)
    grpo_grad = grad_of(GrpoLoss(), *make_batch(ratios, mask, adv))
    assert grpo_grad.item() == 0.0  # contrast: the hard clip kills the gradient


@pytest.mark.parametrize(
    ("r", "a", "zero"),
    [
        (1.5, 1.0, True),  # past 1+eps_high in the direction of A>0
        (0.5, -1.0, True),  # past 1-eps_low in the direction of A<0
        (1.1, 1.0, False),  # inside the band
        (0.9, -1.0, False),
        (0.5, 1.0, False),  # outside, but against the direction of A: PPO keeps the gradient
        (1.5, -1.0, False),
    ],
)
def test_grpo_gradient_zero_exactly_past_band(r, a, zero):
    grad = grad_of(GrpoLoss(), *make_batch([[r]], [[1]], [a])).item()
    if zero:
        assert grad == 0.0
    else:
        assert grad == pytest.approx(-r * a, rel=1e-6)


def test_grpo_dual_clip_zeroes_gradient_for_huge_negative_ratio():
    assert grad_of(GrpoLoss(dual_clip=3.0), *make_batch([[5.0]], [[1]], [-1.0])).item() == 0.0
    assert grad_of(GrpoLoss(), *make_batch([[5.0]], [[1]], [-1.0])).item() == pytest.approx(5.0, rel=1e-6)


def test_gspo_ratio_is_length_normalised_geometric_mean():
    ratios = [[2.0, 0.5, 4.0], [1.2, 0.8, 7.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    loss_fn = GspoLoss(eps_low=0.999, eps_high=1e6)  # effectively unclipped: loss = -s·A
    loss, metrics = loss_fn.compute(*make_batch(ratios, mask, [1.0, 0.0]))
    s0 = (2.0 * 0.5 * 4.0) ** (1 / 3)
    s1 = (1.2 * 0.8) ** (1 / 2)
    assert loss.item() == pytest.approx(-s0 / 2, rel=1e-6)
    assert metrics["ratio/seq_max"].item() == pytest.approx(s0, rel=1e-6)
    assert metrics["ratio/seq_min"].item() == pytest.approx(s1, rel=1e-6)
    # d(-s0·A)/d logp_t = -s0/|y| for every token of the sequence (then /G = 2).
    grad = grad_of(loss_fn, *make_batch(ratios, mask, [1.0, 0.0]))
    torch.testing.assert_close(grad[0], torch.full((3,), -s0 / 3 / 2))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spread", [1e-4, 0.3])  # inside and well outside the 3e-4/4e-4 band
def test_gspo_token_equals_gspo_for_sequence_advantages(mode, spread):
    gen = torch.Generator().manual_seed(0)
    ratios = (1.0 + spread * torch.randn(5, 7, generator=gen)).clamp(min=0.05).tolist()
    mask = (torch.rand(5, 7, generator=gen) > 0.3).long()
    mask[2] = 0
    adv = torch.randn(5, generator=gen).tolist()
    batch = make_batch(ratios, mask.tolist(), adv)
    losses, grads = [], []
    for name in ["gspo", "gspo_token"]:
        loss_fn = GspoLoss(name=name, agg=mode, max_len=7)
        losses.append(loss_fn.compute(*batch)[0])
        grads.append(grad_of(loss_fn, *batch))
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0].abs().sum() > 0


def test_sapo_sequence_level_gates_the_sequence_ratio():
    ratios, mask, adv = [[2.0, 0.5, 4.0]], [[1, 1, 1]], [1.0]
    batch = make_batch(ratios, mask, adv)
    s = (2.0 * 0.5 * 4.0) ** (1 / 3)
    loss, _ = SapoLoss(level="sequence").compute(*batch)
    assert loss.item() == pytest.approx(-4.0 / (1 + math.exp(-(s - 1))), rel=1e-6)
    grad = grad_of(SapoLoss(level="sequence"), *batch)
    # Each token: w(s)·s·A / |y|, the same for every token of the sequence.
    torch.testing.assert_close(grad[0], torch.full((3,), -sech2((s - 1) / 2) * s / 3))


def test_rows_and_valid_rows_agree():  # guards the reference helper used above
    assert [len(r) for r in valid_rows(RATIOS)] == [3, 2, 0, 3]
