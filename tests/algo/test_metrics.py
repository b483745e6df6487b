"""Metric values against hand counts; all metrics are detached 0-d tensors."""

from __future__ import annotations

import math

import pytest
import torch

from sapo_megatron.algo import TIS, GrpoLoss, GspoLoss, IcePop, SapoLoss, mismatch_metrics
from tests.algo.reference import make_batch, sech2


def test_grpo_clip_fractions_and_ratio_stats():
    # valid tokens: (r, A) = (1.5, +1) high-clipped, (0.5, -1) low-clipped, (1.1, +1), (0.5, +1), (1.5, -1)
    ratios = [[1.5, 0.5, 9.0], [1.1, 0.5, 1.5]]
    adv_bt = torch.tensor([[1.0, -1.0, 1.0], [1.0, 1.0, -1.0]])
    logp, old, _, mask = make_batch(ratios, [[1, 1, 0], [1, 1, 1]], [0.0, 0.0])
    _, metrics = GrpoLoss().compute(logp, old, adv_bt, mask)
    assert metrics["clip/frac_high"].item() == pytest.approx(1 / 5)
    assert metrics["clip/frac_low"].item() == pytest.approx(1 / 5)
    assert metrics["clip/frac"].item() == pytest.approx(2 / 5)
    assert metrics["ratio/min"].item() == pytest.approx(0.5, rel=1e-6)
    assert metrics["ratio/max"].item() == pytest.approx(1.5, rel=1e-6)  # 9.0 is padding
    assert metrics["ratio/mean"].item() == pytest.approx((1.5 + 0.5 + 1.1 + 0.5 + 1.5) / 5, rel=1e-6)
    _, dual = GrpoLoss(dual_clip=1.2).compute(logp, old, adv_bt, mask)
    assert dual["clip/frac_dual"].item() == pytest.approx(1 / 5)  # (1.5, -1): r > c


def test_gspo_clip_fraction_counts_sequences():
    # s = 1.01 (A>0: clipped), s = 1.0001 (inside), a 1-token sequence s = 0.9 (A<0: clipped), an empty row
    ratios = [[1.01, 1.01, 1.01], [1.0001, 1.0001, 1.0001], [0.9, 1.0, 1.0], [1.0, 1.0, 1.0]]
    mask = [[1, 1, 1], [1, 1, 1], [1, 0, 0], [0, 0, 0]]
    _, metrics = GspoLoss().compute(*make_batch(ratios, mask, [1.0, 1.0, -1.0, 1.0]))
    assert metrics["clip/frac"].item() == pytest.approx(2 / 3)  # tokens would say 4/7
    assert metrics["clip/frac_high"].item() == pytest.approx(1 / 3)
    assert metrics["clip/frac_low"].item() == pytest.approx(1 / 3)
    assert metrics["ratio/seq_min"].item() == pytest.approx(0.9, rel=1e-5)


def test_sapo_gate_metrics_split_by_advantage_sign():
    ratios = [[1.0, 3.0, 0.5], [1.2, 4.0, 1.0]]
    adv_bt = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, 1.0]])
    logp, old, _, mask = make_batch(ratios, [[1, 1, 1], [1, 1, 0]], [0.0, 0.0])
    _, metrics = SapoLoss(tau_pos=1.0, tau_neg=2.0).compute(logp, old, adv_bt, mask)
    w_pos = [sech2(0.0), sech2(2.0 / 2)]  # (1.0, +), (3.0, +)
    w_neg = [sech2(2.0 * 0.2 / 2), sech2(2.0 * 3.0 / 2)]  # (1.2, -), (4.0, -)
    w_zero = sech2(2.0 * -0.5 / 2)  # (0.5, A=0) uses tau_neg, counted only in the overall mean
    assert metrics["sapo/w_mean_pos"].item() == pytest.approx(sum(w_pos) / 2, rel=1e-5)
    assert metrics["sapo/w_mean_neg"].item() == pytest.approx(sum(w_neg) / 2, rel=1e-5)
    assert metrics["sapo/w_mean"].item() == pytest.approx((sum(w_pos) + sum(w_neg) + w_zero) / 5, rel=1e-5)
    # pos: w = 1 and sech²(1) = 0.42 → 1 of 2 below 0.5; neg: sech²(0.2) = 0.96 and sech²(3) = 0.01 → 1 of 2
    assert metrics["sapo/frac_w_lt_half_pos"].item() == pytest.approx(1 / 2)
    assert metrics["sapo/frac_w_lt_half_neg"].item() == pytest.approx(1 / 2)
    _, on_policy = SapoLoss().compute(logp, logp.detach(), adv_bt, mask)
    assert on_policy["sapo/w_mean"].item() == pytest.approx(1.0)
    assert on_policy["sapo/frac_w_lt_half_neg"].item() == 0.0


def test_kl_to_the_old_policy_and_the_gates_spread_within_sequences():
    # Row 0: r = 1, 3 (A > 0, τ_pos 1); row 1: r = 2 alone (A < 0, τ_neg 2); row 1's second token is padding.
    ratios = [[1.0, 3.0], [2.0, 5.0]]
    logp, old, _, mask = make_batch(ratios, [[1, 1], [1, 0]], [1.0, -1.0])
    _, metrics = SapoLoss(tau_pos=1.0, tau_neg=2.0).compute(logp, old, torch.tensor([1.0, -1.0]), mask)
    # k3(old ‖ π) per token with d = log(1/r): 1/r − log(1/r) − 1 = 1/r + log r − 1.
    k3 = [1 / r + math.log(r) - 1 for r in (1.0, 3.0, 2.0)]
    assert metrics["policy/kl_old"].item() == pytest.approx(sum(k3) / 3, rel=1e-5)
    # Row 0's gates 1 and sech²(1): population std |1 − sech²(1)| / 2; row 1 has one token: std 0.
    assert metrics["sapo/seq_w_std"].item() == pytest.approx(abs(1 - sech2(1.0)) / 2 / 2, rel=1e-5)


def test_mismatch_metrics_hand_values():
    deltas = [math.log(3.0), math.log(0.4), 0.1, 5.0]
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    rollout = -torch.tensor([[deltas[0], deltas[1]], [deltas[2], deltas[3]]])
    mask = torch.tensor([[1, 1], [1, 0]])
    metrics = mismatch_metrics(old, rollout, mask)
    valid = deltas[:3]
    assert metrics["mismatch/k3"].item() == pytest.approx(
        sum(math.exp(d) - d - 1 for d in valid) / 3, rel=1e-5
    )
    assert metrics["mismatch/abs_delta_mean"].item() == pytest.approx(
        sum(abs(d) for d in valid) / 3, rel=1e-5
    )
    assert metrics["mismatch/frac_ratio_gt_2"].item() == pytest.approx(1 / 3)
    assert metrics["mismatch/frac_ratio_lt_0.5"].item() == pytest.approx(1 / 3)


def test_is_weight_metric():
    logp, old, adv, mask = make_batch([[1.0, 1.0]], [[1, 1]], [1.0])
    rollout = old - torch.tensor([[math.log(3.0), math.log(0.8)]])
    _, tis = GrpoLoss().compute(logp, old, adv, mask, rollout_logp_bt=rollout, correction=TIS(cap=2.0))
    assert tis["mismatch/is_weight_mean"].item() == pytest.approx((2.0 + 0.8) / 2, rel=1e-5)
    _, icepop = GrpoLoss().compute(logp, old, adv, mask, rollout_logp_bt=rollout, correction=IcePop())
    assert icepop["mismatch/is_weight_mean"].item() == pytest.approx(0.8 / 2, rel=1e-5)


METRIC_GROUPS = {"loss", "sapo", "clip", "ratio", "mismatch", "kl", "entropy", "policy"}


@pytest.mark.parametrize(
    "loss_fn", [SapoLoss(), SapoLoss(level="sequence"), GrpoLoss(dual_clip=3.0), GspoLoss()]
)
def test_metrics_are_detached_scalars(loss_fn):
    logp, old, adv, mask = make_batch()
    entropy = torch.rand(4, 3, requires_grad=True)
    _, metrics = loss_fn.model_copy(update={"kl_coef": 0.1, "entropy_coef": 0.01}).compute(
        logp,
        old,
        adv,
        mask,
        rollout_logp_bt=old + 0.01,
        ref_logp_bt=old,
        entropy_bt=entropy,
        correction=TIS(),
    )
    for key, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad and value.dtype == torch.float32, key
        assert key.split("/")[0] in METRIC_GROUPS, key
    assert {"loss/total", "loss/pg", "loss/kl", "loss/entropy_bonus", "kl/k3_ref", "entropy"} <= set(metrics)


def _reductions(loss, *batch, **kwargs) -> dict[str, tuple[str, bool]]:
    _, metrics = loss.compute(*batch, **kwargs)
    return {name: (m.reduce.value, m.per_update) for name, m in metrics.items_with_reduction()}


def test_every_metric_is_made_with_its_reduction():
    """Each loss says how its metrics pool (the engine weights them by it) and which are per-update diagnostics."""
    batch = make_batch([[1.2, 0.8, 1.0], [0.9, 1.1, 1.0]], [[1, 1, 0], [1, 1, 1]], [1.0, -1.0])
    ref = {"ref_logp_bt": batch[1] - 0.1, "entropy_bt": torch.rand(2, 3), "rollout_logp_bt": batch[1] + 0.05}
    token, seq, pos, neg = "token_mean", "sequence_mean", "pos_token_mean", "neg_token_mean"
    common = {
        "ratio/min": ("min", False),
        "ratio/mean": (token, True),
        "ratio/max": ("max", False),
        "policy/kl_old": (token, True),
        "mismatch/k3": (token, False),
        "mismatch/abs_delta_mean": (token, False),
        "mismatch/frac_ratio_gt_2": (token, False),
        "mismatch/frac_ratio_lt_0.5": (token, False),
        "loss/pg": ("sum", False),
        "kl/k3_ref": (token, False),
        "entropy": (token, False),
        "loss/total": ("sum", False),
    }
    sapo = {
        "sapo/seq_w_std": (seq, True),
        "sapo/w_mean": (token, True),
        "sapo/w_mean_pos": (pos, True),
        "sapo/w_mean_neg": (neg, True),
        "sapo/frac_w_lt_half_pos": (pos, True),
        "sapo/frac_w_lt_half_neg": (neg, True),
    }
    assert _reductions(SapoLoss(), *batch, **ref) == {**sapo, **common}
    clip = {f"clip/{k}": (token, True) for k in ("frac_high", "frac_low", "frac")}
    assert _reductions(GrpoLoss(kl_coef=0.1), *batch, **ref) == {**clip, **common, "loss/kl": ("sum", False)}
    gspo = _reductions(GspoLoss(), *batch, **ref)
    assert {name: gspo[name] for name in clip} == {name: (seq, True) for name in clip}  # GSPO clips sequences
    assert gspo["ratio/seq_mean"] == (seq, False) and gspo["ratio/seq_max"] == ("max", False)


BASELINE_GROUPS = METRIC_GROUPS | {"cispo", "dppo", "m2po", "rollout_corr"}


@pytest.mark.parametrize("name", ["cispo", "gmpo", "dppo_tv", "dppo_kl", "m2po"])
def test_the_baselines_metrics_are_detached_scalars_with_their_reduction(name):
    from sapo_megatron.algo import RolloutCorrection, build_policy_loss

    batch = make_batch([[1.2, 0.8, 1.0], [0.9, 1.1, 1.0]], [[1, 1, 0], [1, 1, 1]], [1.0, -1.0])
    loss = build_policy_loss({"name": name, "kl_coef": 0.1, **({"ratio_cap": 1.1} if "dppo" in name else {})})
    correction = RolloutCorrection(reject=[{"stat": "token_k2", "upper": 0.5}])
    _, metrics = loss.compute(
        *batch, rollout_logp_bt=batch[1] + 0.05, ref_logp_bt=batch[1], correction=correction
    )
    for key, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad and value.dtype == torch.float32, key
        assert key.split("/")[0] in BASELINE_GROUPS, key
    reductions = {n: (m.reduce.value, m.per_update) for n, m in metrics.items_with_reduction()}
    assert {n: r for n, r in reductions.items() if n.startswith("rollout_corr/")} == {
        "rollout_corr/weight_mean": ("token_mean", False),
        "rollout_corr/truncated_frac": ("token_mean", False),
        "rollout_corr/rejected_frac": ("token_mean", False),
        "rollout_corr/rejected_frac_token_k2": ("token_mean", False),
    }
    own = {n: r for n, r in reductions.items() if n.split("/")[0] in ("clip", "cispo", "dppo", "m2po")}
    assert own and all(per_update for _, per_update in own.values())  # logged per update as mb{i}/...
    expected = "pos_token_mean" if name == "cispo" else "token_mean"
    assert reductions.get("cispo/frac_capped_pos", (expected, True))[0] == expected
