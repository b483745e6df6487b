"""verl-style rollout corrections (``RolloutCorrection``) against an independent reference of
volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7 ``verl/trainer/ppo/rollout_corr_helper.py``
(``compute_rollout_correction_weights``: token / sequence IS weights, ``.clamp(max=threshold)``;
``compute_rollout_rejection_mask``: the token_k*, seq_sum_k*, seq_mean_k*, seq_max_k* options, k1 with
``lower_upper`` bounds compared in log space), written per row with plain ``math``; composed with every loss."""

from __future__ import annotations

import math

import pytest
import torch

from sapo_megatron.algo import POLICY_LOSSES, RejectRule, RolloutCorrection, build_policy_loss
from sapo_megatron.algo.mismatch import correction_weights

ROWS = 5


def _data(seed=0):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(ROWS, 7, generator=gen) * 0.5 - 2.0
    rollout = old + torch.randn(ROWS, 7, generator=gen) * 0.4
    lengths = [7, 4, 0, 6, 2]
    mask = torch.tensor([[t < n for t in range(7)] for n in lengths])
    return old, rollout, mask


def _ref_stats(deltas, stat):
    """verl's statistic for one sequence's valid deltas (a list), per token or one value."""
    est = stat.rsplit("_", 1)[1]
    tok = [{"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - 1 - d}[est] for d in deltas]
    if stat.startswith("token"):
        return tok
    if stat.startswith("seq_sum"):
        value = sum(tok)
    elif stat.startswith("seq_mean"):
        value = sum(tok) / len(tok) if tok else 0.0
    else:
        value = max(tok) if tok else 0.0
    return [value] * len(deltas)


def _ref_keep(deltas, stat, lower, upper):
    values = _ref_stats(deltas, stat)
    if stat.endswith("k1"):
        return [math.log(lower) <= v <= math.log(upper) for v in values]
    return [v <= upper for v in values]


def _ref_is(deltas, level, cap):
    if level is None:
        return [1.0] * len(deltas)
    if level == "token":
        return [min(math.exp(d), cap) for d in deltas]
    total = sum(deltas) if level == "sequence" else (sum(deltas) / len(deltas) if deltas else 0.0)
    return [min(math.exp(max(-20.0, min(20.0, total))), cap)] * len(deltas)


RULES = [
    ("token_k1", 0.7, 1.3),
    ("token_k2", None, 0.05),
    ("token_k3", None, 0.05),
    ("seq_sum_k1", 0.5, 2.0),
    ("seq_sum_k2", None, 0.2),
    ("seq_sum_k3", None, 0.2),
    ("seq_mean_k1", 0.8, 1.25),
    ("seq_mean_k2", None, 0.04),
    ("seq_mean_k3", None, 0.04),
    ("seq_max_k2", None, 0.1),
    ("seq_max_k3", None, 0.1),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric", None])
@pytest.mark.parametrize("rule", RULES, ids=[r[0] for r in RULES])
def test_weights_equal_verl(seed, level, rule):
    old, rollout, mask = _data(seed)
    stat, lower, upper = rule
    corr = RolloutCorrection(
        is_level=level, is_threshold=1.5, reject=[{"stat": stat, "lower": lower, "upper": upper}]
    )
    got = correction_weights(corr, old, rollout, mask)
    kept = 0
    for i in range(ROWS):
        deltas = [(old[i, t] - rollout[i, t]).item() for t in range(7) if mask[i, t]]
        keep = _ref_keep(deltas, stat, lower, upper)
        weights = _ref_is(deltas, level, 1.5)
        expected = [w if k else 0.0 for w, k in zip(weights, keep)]
        kept += sum(keep)
        assert got[i][mask[i]].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7), (i, stat)
        assert (got[i][~mask[i]] == 0).all()
    metrics = corr.metrics((old - rollout), mask)
    assert metrics["rollout_corr/rejected_frac"].item() == pytest.approx(
        1 - kept / mask.sum().item(), abs=1e-6
    )


def test_rules_compose_and_the_diagnostics_count():
    old, rollout, mask = _data(2)
    delta = old - rollout
    rules = [RejectRule(stat="token_k2", upper=0.05), RejectRule(stat="seq_max_k3", upper=0.2)]
    corr = RolloutCorrection(is_level="token", is_threshold=1.2, reject=rules)
    keep = rules[0].keep(delta, mask) & rules[1].keep(delta, mask)
    assert torch.equal(corr.keep(delta, mask), keep)
    metrics = corr.metrics(delta, mask)
    truncated = ((delta.exp() > 1.2) & mask).sum() / mask.sum()
    assert metrics["rollout_corr/truncated_frac"].item() == pytest.approx(truncated.item())
    assert 0 < metrics["rollout_corr/rejected_frac"] < 1
    assert set(metrics) >= {"rollout_corr/rejected_frac_token_k2", "rollout_corr/rejected_frac_seq_max_k3"}


def test_bad_rules_are_refused_in_one_line():
    with pytest.raises(ValueError, match="token_k1 needs lower < upper"):
        RejectRule(stat="token_k1", upper=1.5)
    with pytest.raises(ValueError, match="takes only upper"):
        RejectRule(stat="seq_max_k2", lower=0.5, upper=1.5)


@pytest.mark.parametrize("name", sorted(set(POLICY_LOSSES) - {"gspo", "gmpo"}))
def test_composes_with_every_loss(name):
    """loss(correction) = loss with each token's policy term multiplied by the correction's weight: checked by
    linearity, as the difference to the uncorrected loss on a batch where one token is rejected."""
    old, rollout, mask = _data(3)
    logp = (old + 0.1).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 0.3, 2.0, -1.0])
    corr = RolloutCorrection(is_level=None, reject=[{"stat": "token_k3", "upper": 10.0}])  # keeps everything
    loss_fn = build_policy_loss({"name": name})
    kwargs = {"rollout_logp_bt": rollout}
    plain, _ = loss_fn.compute(logp, old, adv, mask, **kwargs)
    same, metrics = loss_fn.compute(logp, old, adv, mask, correction=corr, **kwargs)
    assert same.item() == pytest.approx(plain.item(), rel=1e-6)
    assert metrics["rollout_corr/rejected_frac"] == 0
    strict = RolloutCorrection(is_level=None, reject=[{"stat": "seq_max_k2", "upper": 1e-4}])  # rejects all
    zero, _ = loss_fn.compute(logp, old, adv, mask, correction=strict, **kwargs)
    assert zero.item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("name", ["gspo", "gmpo"])
def test_composes_with_sequence_losses(name):
    old, rollout, mask = _data(4)
    logp = (old + 0.05).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 0.3, 2.0, -1.0])
    loss_fn = build_policy_loss({"name": name})
    corr = RolloutCorrection(is_level="geometric", is_threshold=1e6)
    got, _ = loss_fn.compute(logp, old, adv, mask, rollout_logp_bt=rollout, correction=corr)
    plain, _ = loss_fn.compute(logp, old, adv, mask)
    assert got.item() != pytest.approx(plain.item())
    (grad,) = torch.autograd.grad(got, logp)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def _ref_normalised(rows_deltas, level, cap):
    """verl's ``rollout_is_batch_normalize`` (``compute_rollout_correction_weights``, same commit): truncate,
    then divide by the batch mean – of every valid token's weight (token level) or of the sequences' weights,
    one per sequence with a valid token (sequence level; geometric here as sequence) – unless it is ≤ 1e-8."""
    weights = [_ref_is(deltas, level, cap) for deltas in rows_deltas]
    if level == "token":
        values = [w for row in weights for w in row]
    else:
        values = [row[0] for row in weights if row]
    mean = sum(values) / len(values)
    factor = mean if mean > 1e-8 else 1.0
    return [[w / factor for w in row] for row in weights], factor


@pytest.mark.parametrize("seed", [0, 1, 5])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_batch_normalised_weights_equal_verl(seed, level):
    old, rollout, mask = _data(seed)
    rollout = old + (rollout - old) * 2.0  # wider mismatch: some weights are truncated at the cap
    corr = RolloutCorrection(is_level=level, is_threshold=1.5, is_batch_normalize=True)
    got = correction_weights(corr, old, rollout, mask)
    deltas = [[(old[i, t] - rollout[i, t]).item() for t in range(7) if mask[i, t]] for i in range(ROWS)]
    expected, factor = _ref_normalised(deltas, level, 1.5)
    for i in range(ROWS):
        assert got[i][mask[i]].tolist() == pytest.approx(expected[i], rel=1e-6, abs=1e-7)
        assert (got[i][~mask[i]] == 0).all()
    assert factor != pytest.approx(1.0, abs=1e-3)  # the normalisation changes the weights
    if level == "token":
        assert got[mask].mean().item() == pytest.approx(1.0, rel=1e-6)
    metrics = corr.metrics(old - rollout, mask)
    assert metrics["rollout_corr/batch_norm_factor"].item() == pytest.approx(factor, rel=1e-6)


def test_batch_mean_over_micro_batches_is_the_whole_batch_mean():
    """The loop passes the step's mean (sums over micro-batches): a micro-batch's weights are then those of the
    whole batch, not normalised over the micro-batch alone; rejection comes after the normalisation."""
    old, rollout, mask = _data(7)
    rollout = old + (rollout - old) * 2.0
    rule = {"stat": "token_k2", "upper": 0.05}
    corr = RolloutCorrection(is_level="sequence", is_threshold=1.5, is_batch_normalize=True, reject=[rule])
    delta = old - rollout
    sums = corr.batch_sums(delta[:2], mask[:2]) + corr.batch_sums(delta[2:], mask[2:])
    mean = sums[0] / sums[1]
    whole = correction_weights(corr, old, rollout, mask)
    part = correction_weights(corr, old[2:], rollout[2:], mask[2:], mean)
    assert torch.allclose(part, whole[2:], rtol=1e-6, atol=1e-7)
    alone = correction_weights(corr, old[2:], rollout[2:], mask[2:])
    assert not torch.allclose(alone, whole[2:], rtol=1e-3)
    deltas = [[(old[i, t] - rollout[i, t]).item() for t in range(7) if mask[i, t]] for i in range(ROWS)]
    expected, _ = _ref_normalised(deltas, "sequence", 1.5)
    for i in range(ROWS):
        keep = _ref_keep(deltas[i], "token_k2", None, 0.05)
        want = [w if k else 0.0 for w, k in zip(expected[i], keep)]
        assert whole[i][mask[i]].tolist() == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_batch_normalize_needs_an_is_weight():
    with pytest.raises(ValueError, match="is_batch_normalize needs an IS weight"):
        RolloutCorrection(is_level=None, is_batch_normalize=True)
