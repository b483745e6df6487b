"""Each policy loss × each aggregation mode against hand calculations (tests/algo/reference.py)."""

from __future__ import annotations

import math

import pytest
import torch

from sapo_megatron.algo import GrpoLoss, GspoLoss, SapoLoss, policy_loss
from tests.algo.reference import (
    ADV,
    MASK,
    MAX_LEN,
    MODES,
    RATIOS,
    clip_ref,
    make_batch,
    per_token,
    ref_agg,
    sapo_ref,
    seq_ratio_ref,
    valid_rows,
)


def gspo_rows(eps_low=3e-4, eps_high=4e-4, ratios=RATIOS, adv=ADV, mask=MASK):
    rows = []
    for a, valid in zip(adv, valid_rows(ratios, mask)):
        s = seq_ratio_ref(valid) if valid else 1.0
        rows.append([clip_ref(s, a, eps_low, eps_high)] * len(valid))
    return rows


EXPECTED_ROWS = {
    "sapo": lambda: valid_rows(per_token(sapo_ref)),
    "grpo": lambda: valid_rows(per_token(lambda r, a: clip_ref(r, a, 0.2, 0.28))),
    "gspo": gspo_rows,
    "gspo_token": gspo_rows,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["sapo", "grpo", "gspo", "gspo_token"])
def test_loss_matches_hand_calculation(name, mode):
    logp, old, adv, mask = make_batch()
    loss, metrics = policy_loss(name, logp, old, adv, mask, agg=mode, max_len=MAX_LEN)
    expected = ref_agg(EXPECTED_ROWS[name](), mode)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["loss/pg"].item() == pytest.approx(expected, rel=1e-5)
    assert metrics["loss/total"].item() == pytest.approx(expected, rel=1e-5)


def test_grpo_hand_values_written_out():
    # Row 0 (A=1.5): r=1 → -1.5; r=5 clipped at 1.28 → -1.92; r=0.1 → -0.15. Row 1 (A=-0.5): r=1.1 → 0.55;
    # r=0.7 clipped at 0.8 → 0.4. Row 3 (A=0) → 0. seq-mean-token-mean over 3 non-empty rows:
    expected = ((-1.5 - 1.92 - 0.15) / 3 + (0.55 + 0.4) / 2 + 0.0) / 3
    loss, _ = GrpoLoss().compute(*make_batch())
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_sapo_on_policy_value_is_minus_two_over_tau_times_adv():
    logp, _, _, mask = make_batch()
    adv = torch.tensor([1.0, -1.0, 0.0, 2.0])
    loss, _ = SapoLoss(tau_pos=2.0, tau_neg=4.0).compute(logp, logp.detach(), adv, mask)
    # f(1) = σ(0)·4/τ = 2/τ; per-sequence mean then mean over the 3 non-empty rows.
    assert loss.item() == pytest.approx((-2 / 2.0 * 1.0 + 2 / 4.0 * 1.0 - 2 / 2.0 * 2.0) / 3, rel=1e-6)


TOKEN_ADV = [[1.0, -2.0, 0.5], [0.3, -0.7, 9.0], [1.0, 1.0, 1.0], [0.0, 2.0, -1.0]]


@pytest.mark.parametrize("mode", MODES)
def test_token_level_advantages(mode):
    logp, old, _, mask = make_batch()
    adv_bt = torch.tensor(TOKEN_ADV)
    sapo, _ = SapoLoss(agg=mode, max_len=MAX_LEN).compute(logp, old, adv_bt, mask)
    grpo, _ = GrpoLoss(agg=mode, max_len=MAX_LEN).compute(logp, old, adv_bt, mask)
    gspo_token, _ = GspoLoss(name="gspo_token", agg=mode, max_len=MAX_LEN).compute(logp, old, adv_bt, mask)
    assert sapo.item() == pytest.approx(
        ref_agg(valid_rows(per_token(sapo_ref, adv=TOKEN_ADV)), mode), rel=1e-5
    )
    grpo_rows = valid_rows(per_token(lambda r, a: clip_ref(r, a, 0.2, 0.28), adv=TOKEN_ADV))
    assert grpo.item() == pytest.approx(ref_agg(grpo_rows, mode), rel=1e-5)
    seq_r = [seq_ratio_ref(v) if v else 1.0 for v in valid_rows(RATIOS)]
    gt_rows = valid_rows([[clip_ref(s, a, 3e-4, 4e-4) for a in row] for s, row in zip(seq_r, TOKEN_ADV)])
    assert gspo_token.item() == pytest.approx(ref_agg(gt_rows, mode), rel=1e-5)


def test_padding_garbage_does_not_leak():
    logp, old, adv, mask = make_batch()
    logp_nan = torch.where(mask.bool(), logp.detach(), torch.nan).requires_grad_()
    old_inf = torch.where(mask.bool(), old, torch.inf)
    for name in ["sapo", "grpo", "gspo", "gspo_token"]:
        clean, _ = policy_loss(name, logp, old, adv, mask)
        dirty, metrics = policy_loss(name, logp_nan, old_inf, adv, mask, ref_logp_bt=old_inf, kl_coef=0.1)
        dirty.backward()
        assert torch.isfinite(logp_nan.grad).all()
        assert all(torch.isfinite(v) for v in metrics.values())
        assert dirty.item() == pytest.approx(clean.item() + metrics["loss/kl"].item(), rel=1e-6)
        logp_nan.grad = None


def test_fully_masked_batch_gives_zero_loss_and_finite_metrics():
    logp, old, adv, _ = make_batch()
    mask = torch.zeros(4, 3, dtype=torch.long)
    for name in ["sapo", "grpo", "gspo", "gspo_token"]:
        loss, metrics = policy_loss(name, logp, old, adv, mask)
        assert loss.item() == 0.0
        assert all(math.isfinite(v.item()) for v in metrics.values())


def test_bf16_inputs_are_computed_in_fp32():
    logp, old, adv, mask = make_batch()
    loss, _ = SapoLoss().compute(logp.detach().bfloat16(), old.bfloat16(), adv.bfloat16(), mask)
    assert loss.dtype == torch.float32
