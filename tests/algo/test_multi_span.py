"""Multi-turn episodes train on a loss mask with several spans (the policy's turns) and holes (tool observations).
Every policy loss and aggregation mode must treat the holes as absent: the loss, its metrics and the gradient on
the sampled tokens equal those of the same rows with the observation tokens cut out."""

from __future__ import annotations

import pytest
import torch

from sapo_megatron.algo import TIS, build_policy_loss

LOSSES = {
    "sapo-seq-mean-token-mean": {"name": "sapo", "kl_coef": 0.02},
    "sapo-token-mean": {"name": "sapo", "agg": "token-mean"},
    "sapo-seq-mean-token-sum-norm": {"name": "sapo", "agg": "seq-mean-token-sum-norm", "max_len": 16},
    "sapo-sequence-level": {"name": "sapo", "level": "sequence"},
    "grpo": {"name": "grpo", "dual_clip": 3.0},
    "grpo-token-mean": {"name": "grpo", "agg": "token-mean"},
    "gspo": {"name": "gspo", "eps_low": 0.05, "eps_high": 0.06},
}


def episodes(seed: int = 0, rows: int = 4, width: int = 16):
    """Rows of three turns with observations between them: mask 1 on the turns, 0 on observations and padding;
    observation tokens carry the values an engine gives them (rollout log-prob 0) and junk elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, width, generator=gen) * 2
    old = logp + 0.2 * torch.randn(rows, width, generator=gen)
    rollout = old + 0.05 * torch.randn(rows, width, generator=gen)
    ref = logp + 0.1 * torch.randn(rows, width, generator=gen)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for r in range(rows):
        lengths = torch.randint(1, 4, (6,), generator=gen).tolist()  # turn, obs, turn, obs, turn, padding
        pos = 0
        for i, n in enumerate(lengths[:5]):
            mask[r, pos : pos + n] = i % 2 == 0
            pos += n
    for t in (old, rollout, ref):
        t[~mask] = 0.0
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])[:rows]
    return logp, old, rollout, ref, adv, mask


def cut_holes(mask: torch.Tensor, *tensors: torch.Tensor):
    """The mask-1 tokens of each row moved to its front (the same rows with observations cut out)."""
    out = [torch.zeros_like(t) for t in tensors]
    compact = torch.zeros_like(mask)
    for r in range(mask.shape[0]):
        keep = mask[r].nonzero().squeeze(1)
        compact[r, : len(keep)] = True
        for src, dst in zip(tensors, out):
            dst[r, : len(keep)] = src[r, keep]
    return compact, out


@pytest.mark.parametrize("name", list(LOSSES))
def test_observation_tokens_are_absent_from_every_loss_and_aggregation(name):
    loss_fn = build_policy_loss(LOSSES[name])
    logp, old, rollout, ref, adv, mask = episodes()
    assert ((mask[:, 1:].int() - mask[:, :-1].int()) == 1).sum() >= mask.shape[0]  # several spans per row
    leaf = logp.clone().requires_grad_()
    loss, metrics = loss_fn.compute(
        leaf, old, adv, mask, rollout_logp_bt=rollout, ref_logp_bt=ref, correction=TIS(cap=2.0)
    )
    loss.backward()

    compact, (c_logp, c_old, c_rollout, c_ref) = cut_holes(mask, logp, old, rollout, ref)
    c_leaf = c_logp.clone().requires_grad_()
    want, want_metrics = loss_fn.compute(
        c_leaf, c_old, adv, compact, rollout_logp_bt=c_rollout, ref_logp_bt=c_ref, correction=TIS(cap=2.0)
    )
    want.backward()

    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-8)
    assert float(loss.detach()) != 0.0
    for metric, value in want_metrics.items():
        assert float(metrics[metric]) == pytest.approx(float(value), rel=1e-5, abs=1e-7), metric
    _, (grad_on_turns,) = cut_holes(mask, leaf.grad)
    torch.testing.assert_close(grad_on_turns, c_leaf.grad, rtol=1e-5, atol=1e-8)
    assert (leaf.grad[~mask] == 0).all()  # observations get no gradient


def test_a_hole_changes_the_sequence_terms():
    """GSPO's sequence ratio is the mean over the mask: filling the holes (training on tool output) changes it –
    the test above would pass trivially if the mask were ignored."""
    loss_fn = build_policy_loss(LOSSES["gspo"])
    logp, old, _, _, adv, mask = episodes(seed=1)
    old_filled = old.clone()
    old_filled[~mask] = -3.0
    filled_mask = torch.zeros_like(mask)
    for r in range(mask.shape[0]):
        last = int(mask[r].nonzero().max())
        filled_mask[r, : last + 1] = True
    with_holes, _ = loss_fn.compute(logp, old_filled, adv, mask)
    without, _ = loss_fn.compute(logp, old_filled, adv, filled_mask)
    assert abs(float(with_holes) - float(without)) > 1e-3
