"""Aggregation modes, token weights, and micro-batch/data-parallel invariance with global normalisers."""

from __future__ import annotations

import pytest
import torch

from sapo_megatron.algo import aggregate, policy_loss, token_weights
from tests.algo.reference import MODES, make_batch

LOSS_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0], [7.0, 8.0, 9.0]])
MASK_BT = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + (4 + 5) / 2) / 2),  # the empty row does not count in G
        ("token-mean", (1 + 2 + 3 + 4 + 5) / 5),
        ("seq-mean-token-sum-norm", (1 + 2 + 3 + 4 + 5) / (2 * 10)),
    ],
)
def test_aggregate_modes(mode, expected):
    assert aggregate(LOSS_BT, MASK_BT, mode, max_len=10).item() == pytest.approx(expected)
    weight_bt = token_weights(MASK_BT, mode, max_len=10)
    assert (LOSS_BT * weight_bt).sum().item() == pytest.approx(expected)
    assert (weight_bt[MASK_BT == 0] == 0).all()


def test_external_normalisers_replace_local_ones():
    assert aggregate(LOSS_BT, MASK_BT, "token-mean", num_tokens=30).item() == pytest.approx(15 / 30)
    smtm = aggregate(LOSS_BT, MASK_BT, "seq-mean-token-mean", num_sequences=torch.tensor(8.0))
    assert smtm.item() == pytest.approx((2 + 4.5) / 8)
    norm = aggregate(LOSS_BT, MASK_BT, "seq-mean-token-sum-norm", num_sequences=5, max_len=3)
    assert norm.item() == pytest.approx(15 / 15)


def test_empty_mask_gives_zero():
    mask = torch.zeros_like(MASK_BT)
    for mode in MODES:
        assert aggregate(LOSS_BT, mask, mode, max_len=4).item() == 0.0


def random_batch(seed=0, batch=6, seq=5):
    gen = torch.Generator().manual_seed(seed)
    ratios = torch.exp(0.4 * torch.randn(batch, seq, generator=gen)).tolist()
    mask = (torch.rand(batch, seq, generator=gen) > 0.35).long()
    mask[1] = 0  # a fully masked sequence
    mask[:, 0] = torch.where(torch.arange(batch) == 1, 0, 1)
    adv = torch.randn(batch, generator=gen).tolist()
    return make_batch(ratios, mask.tolist(), adv)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["sapo", "grpo", "gspo", "gspo_token"])
@pytest.mark.parametrize("split", [[2, 4], [1, 1, 4], [3, 3]])
def test_micro_batches_with_global_normalisers_sum_to_full_batch(name, mode, split):
    logp, old, adv, mask = random_batch()
    settings = {"agg": mode, "max_len": 5, "kl_coef": 0.1, "ref_logp_bt": old - 0.05}
    full, _ = policy_loss(name, logp, old, adv, mask, **settings)
    (full_grad,) = torch.autograd.grad(full, logp)
    num_sequences = (mask.sum(-1) > 0).sum()  # what an all-reduce over ranks would give
    num_tokens = mask.sum()
    total, offset = 0.0, 0
    for size in split:
        rows = slice(offset, offset + size)
        offset += size
        part = {**settings, "ref_logp_bt": settings["ref_logp_bt"][rows]}
        loss, _ = policy_loss(
            name,
            logp[rows],
            old[rows],
            adv[rows],
            mask[rows],
            num_sequences=num_sequences,
            num_tokens=num_tokens,
            **part,
        )
        total = total + loss
    (split_grad,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(split_grad, full_grad)


def test_local_normalisers_would_differ():  # the test above is not vacuous
    logp, old, adv, mask = random_batch()
    full, _ = policy_loss("grpo", logp, old, adv, mask, agg="token-mean")
    parts = sum(
        policy_loss("grpo", logp[s], old[s], adv[s], mask[s], agg="token-mean")[0]
        for s in (slice(0, 1), slice(1, 6))
    )
    assert abs(parts.item() - full.item()) > 1e-3
