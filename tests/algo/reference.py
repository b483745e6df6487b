"""Shared small batch and independent per-token reference formulas (plain ``math``, no package code)."""

from __future__ import annotations

import math

import torch

# 4 sequences × 3 tokens: ratios far from 1 (5, 0.1), a padded token, a fully masked row, a zero advantage.
RATIOS = [[1.0, 5.0, 0.1], [1.1, 0.7, 1.0], [1.0, 1.0, 1.0], [0.9, 1.3, 1.0]]
MASK = [[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 1, 1]]
ADV = [1.5, -0.5, 2.0, 0.0]
MODES = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
MAX_LEN = 4


def make_batch(ratios=RATIOS, mask=MASK, adv=ADV):
    """(logp_bt with grad, old_logp_bt, adv, mask_bt) with exp(logp - old) = ratios."""
    ratio_bt = torch.tensor(ratios, dtype=torch.float64)
    logp_bt = -0.3 - 0.2 * torch.arange(ratio_bt.numel(), dtype=torch.float64).reshape(ratio_bt.shape)
    old_bt = (logp_bt - ratio_bt.log()).float()
    return logp_bt.float().requires_grad_(), old_bt, torch.tensor(adv), torch.tensor(mask)


def valid_rows(values, mask=MASK):
    """Per sequence, the list of values at valid tokens ([] for a fully masked row)."""
    return [[v for v, m in zip(row, mrow) if m] for row, mrow in zip(values, mask)]


def ref_agg(rows, mode, max_len=MAX_LEN):
    """Aggregate per-sequence lists of valid token losses exactly as ALGORITHMS.md writes the three modes."""
    rows = [r for r in rows if r]
    total = sum(sum(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    if mode == "token-mean":
        return total / sum(len(r) for r in rows)
    return total / (len(rows) * max_len)


def sapo_ref(r, a, tau_pos=1.0, tau_neg=1.05):
    tau = tau_pos if a > 0 else tau_neg
    return -(4.0 / tau) / (1.0 + math.exp(-tau * (r - 1.0))) * a


def sech2(x):
    return 1.0 / math.cosh(x) ** 2


def clip_ref(r, a, eps_low, eps_high, dual_clip=None):
    loss = -min(r * a, min(max(r, 1.0 - eps_low), 1.0 + eps_high) * a)
    if dual_clip is not None and a < 0:
        loss = min(loss, -dual_clip * a)
    return loss


def seq_ratio_ref(ratios_row):
    return math.exp(sum(math.log(r) for r in ratios_row) / len(ratios_row))


def per_token(fn, ratios=RATIOS, adv=ADV):
    """fn(r, a) at every token, advantage broadcast per sequence (or given per token)."""
    return [
        [fn(r, a_row[t] if isinstance(a_row, list) else a_row) for t, r in enumerate(row)]
        for row, a_row in zip(ratios, adv)
    ]
