"""SAF stages on hand-made numbers, by the authors' rules (kissshhot/SAF-OPD ray_trainer.py): sparsify (quantile,
ties, masks), compress, and the warm-up/anneal schedule with the lagged KL signal."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sapo_megatron.algo import SAFSchedule, saf_compress, saf_keep_mask, saf_sparsify

NAN, INF = float("nan"), float("inf")


def test_sparsify_hand_example_with_ties_and_different_lengths():
    # τ per row = torch.quantile(|A| over its response tokens, 1 − keep), linear interpolation; |A| >= τ kept.
    adv = torch.tensor(
        [
            # n=5, q=0.8: position 3.2 of [0.1, 0.5, 0.5, 2, 2] -> τ = 2: both tied 2s kept. Padding (9) ignored.
            [0.5, -2.0, 2.0, 0.1, -0.5, 9.0, 9.0, 9.0],
            # prompt (5.0) ignored; n=7: position 4.8 of [0.1, 0.2, 0.3 × 5] -> τ = 0.3: all five ties kept.
            [5.0, 0.3, 0.1, -0.3, 0.2, 0.3, 0.3, 0.3],
            # no response tokens: stays zero whatever the values.
            [4.0, -4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            # n=8: position 5.6 of [0.1 .. 0.8] -> τ = 0.66: the two largest |adv|.
            [0.1, -0.2, 0.3, -0.4, 0.5, -0.6, 0.7, -0.8],
        ]
    )
    mask = torch.tensor(
        [
            [1, 1, 1, 1, 1, 0, 0, 0],
            [0, 1, 1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1],
        ]
    )
    expected = torch.tensor(
        [
            [0.0, -2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.3, 0.0, -0.3, 0.0, 0.3, 0.3, 0.3],
            [0.0] * 8,
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.7, -0.8],
        ]
    )
    assert torch.equal(saf_sparsify(adv, mask, keep=0.2), expected)
    assert saf_keep_mask(adv, mask, keep=0.2).sum(-1).tolist() == [2, 5, 0, 2]


@pytest.mark.parametrize(
    ("n", "keep", "kept"),
    [
        (7, 0.2, 2),  # position 4.8 -> τ = 5.8
        (5, 0.2, 1),  # position 3.2 -> τ = 4.2
        (5, 0.5, 3),  # position 2 -> τ = 3, kept
        (3, 0.01, 1),  # position 1.98 -> τ = 2.98
        (4, 0.6, 2),  # position 1.2 -> τ = 2.2: two, where ceil(keep · n) would keep three
        (6, 1.0, 6),  # keep=1 keeps every response token
    ],
)
def test_sparsify_count_follows_the_quantile(n, keep, kept):
    adv = torch.arange(1.0, n + 1.0)[None]  # distinct values 1..n: the largest `kept` survive
    out = saf_sparsify(adv, torch.ones(1, n), keep=keep)
    assert int((out != 0).sum()) == kept
    assert out[0, n - kept :].tolist() == adv[0, n - kept :].tolist()


def authors_rule(adv: torch.Tensor, mask: torch.Tensor, keep: float) -> torch.Tensor:
    """SAF-OPD's apply_topk_sparse_filter as its docstring states it: per row, torch.quantile of |A| on the
    response tokens at 1 − k/100, keep |A| >= τ (the authors' loop, written out here)."""
    kept = torch.zeros_like(mask, dtype=torch.bool)
    for i in range(adv.shape[0]):
        valid = mask[i].bool()
        if valid.any():
            tau = torch.quantile(adv[i][valid].abs().float(), 1.0 - keep)
            kept[i] = valid & (adv[i].abs() >= tau)
    return kept


def test_sparsify_equals_the_authors_rule_with_many_ties_and_long_rows():
    gen = torch.Generator().manual_seed(3)
    adv = (torch.randn(16, 300, generator=gen) * 4).round() / 4  # quarter steps: many ties
    mask = torch.rand(16, 300, generator=gen) < 0.7
    mask[3] = False  # an empty row
    for keep in (0.05, 0.2, 0.5, 0.99):
        assert torch.equal(saf_keep_mask(adv, mask, keep), authors_rule(adv, mask, keep)), keep
    tied = torch.tensor([[0.5, -1.0] * 50])  # fifty tokens tied at |1.0| above the 0.8 quantile: all kept
    kept = saf_keep_mask(tied, torch.ones(1, 100), keep=0.2)
    assert kept.nonzero()[:, 1].tolist() == list(range(1, 100, 2))


def test_sparsify_keep_one_is_identity_on_the_mask():
    adv = torch.tensor([[0.0, 1.5, -2.0, 3.0], [7.0, 0.25, 0.25, -1.0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    assert torch.equal(saf_sparsify(adv, mask, keep=1.0), torch.where(mask.bool(), adv, 0.0))


def test_sparsify_input_checks():
    adv, mask = torch.tensor([[1.0, NAN]]), torch.tensor([[1, 0]])
    assert saf_sparsify(adv, mask, keep=0.5).tolist() == [[1.0, 0.0]]  # nan off the mask is ignored
    with pytest.raises(ValueError, match="non-finite values on response tokens"):
        saf_sparsify(adv, torch.tensor([[1, 1]]))
    for keep in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"0 < keep <= 1"):
            saf_sparsify(adv, mask, keep=keep)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        saf_sparsify(torch.ones(3), torch.ones(3))


def test_compress_values_and_bound():
    adv = torch.tensor([[0.0, 1.0, -3.0, 100.0]])
    assert saf_compress(adv, c=0.1)[0].tolist() == pytest.approx(
        [0.0, 0.1 * math.tanh(1.0), 0.1 * math.tanh(-3.0), 0.1], rel=1e-6
    )
    assert saf_compress(adv, c=2.0)[0, 1].item() == pytest.approx(2.0 * math.tanh(1.0), rel=1e-6)
    big = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 50
    assert (saf_compress(big, c=0.3).abs() <= torch.tensor(0.3)).all()  # 0.3 as an fp32 value
    with pytest.raises(ValueError, match="c > 0"):
        saf_compress(adv, c=0.0)


# ---------------------------------------------------------------------------------------------- schedule


def run(schedule: SAFSchedule, kls) -> list[float]:
    return [schedule.update(kl) for kl in kls]


def test_warmup_ramp_ends_at_warmup_steps():
    schedule = SAFSchedule(warmup_steps=4, anneal_steps=None)
    assert run(schedule, [None, 1.0, 1.0, 1.0, 1.0, 1.0]) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert schedule.warmup_ended and schedule.warmup_end_step == 4


def test_warmup_stops_early_when_kl_drops_and_freezes_the_scale():
    schedule = SAFSchedule(warmup_steps=10, kl_drop=0.2, anneal_steps=None)
    # Step 1 has no KL yet (the signal is the previous update's); KL_0 = 1.0 is the first seen, at step 2.
    # 0.81 is a 19 % drop (not enough); 0.79 is 21 %: warm-up ends at step 5 with scale 0.5, and stays there
    # even when the KL rises again.
    kls = [None, 1.0, 0.9, 0.81, 0.79, 0.5, 2.0]
    assert run(schedule, kls) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5])
    assert (schedule.warmup_end_step, schedule.kl_first) == (5, 1.0)
    assert (schedule.scale, schedule.coef, schedule.multiplier) == pytest.approx((0.5, 1.0, 0.5))
    # kl_drop is the threshold: with 0.1 the 19 % drop at step 4 already ends warm-up.
    lower = SAFSchedule(warmup_steps=10, kl_drop=0.1, anneal_steps=None)
    assert run(lower, [None, 1.0, 0.9, 0.81, 0.79]) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4])
    # kl_drop 0 is the authors' "no early stop": even a KL falling to 0 leaves the ramp to run to W.
    never = SAFSchedule(warmup_steps=4, kl_drop=0.0, anneal_steps=None)
    assert run(never, [None, 1.0, 0.1, 0.0, 0.0]) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert never.warmup_end_step == 4


def test_no_early_stop_without_a_positive_first_kl():
    schedule = SAFSchedule(warmup_steps=3, anneal_steps=None)
    assert run(schedule, [None, 0.0, -0.5, 0.0]) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    assert schedule.warmup_end_step == 3


def test_anneal_after_warmup_and_floor():
    # The anneal activates on the step warm-up ends (its counter t = 0 there), then decays by 1/R a step.
    kls = [None] + [1.0] * 6
    assert run(SAFSchedule(warmup_steps=2, anneal_steps=4), kls) == pytest.approx(
        [0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    )
    floored = SAFSchedule(warmup_steps=2, anneal_steps=4, floor=0.2)
    assert run(floored, kls) == pytest.approx([0.5, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    assert (floored.scale, floored.coef) == pytest.approx((1.0, 0.2))


def test_anneal_starts_at_the_early_stop_with_the_frozen_scale():
    schedule = SAFSchedule(warmup_steps=10, anneal_steps=2)
    assert run(schedule, [None, 1.0, 0.5, 0.5, 0.5]) == pytest.approx([0.1, 0.2, 0.3, 0.15, 0.0])
    assert schedule.warmup_end_step == 3


def test_anneal_total_steps_sets_the_remaining_budget():
    # R = max(1, S − s): S = 6 after a natural end at s = 2 anneals like R = 4 (anneal_steps is then unused).
    natural = SAFSchedule(warmup_steps=2, anneal_steps=100, anneal_total_steps=6)
    assert run(natural, [None] + [1.0] * 5) == pytest.approx([0.5, 1.0, 0.75, 0.5, 0.25, 0.0])
    # An early stop at s = 3 with S = 5 leaves R = 2.
    early = SAFSchedule(warmup_steps=10, anneal_steps=100, anneal_total_steps=5)
    assert run(early, [None, 1.0, 0.5, 0.5, 0.5]) == pytest.approx([0.1, 0.2, 0.3, 0.15, 0.0])
    # Without warm-up s = 0: R = S; and S at or before the warm-up end still anneals over one step.
    assert run(SAFSchedule(warmup_steps=None, anneal_total_steps=3), [None] * 4) == pytest.approx(
        [1.0, 2 / 3, 1 / 3, 0.0]
    )
    late = SAFSchedule(warmup_steps=4, anneal_total_steps=2)
    assert run(late, [None] * 5) == pytest.approx([0.25, 0.5, 0.75, 1.0, 0.0])


def test_stages_switched_off():
    no_warmup = SAFSchedule(warmup_steps=None, anneal_steps=4)
    assert no_warmup.warmup_ended and no_warmup.warmup_end_step == 0
    # The authors' anneal without warm-up starts at 1 on step 1 (t = 0 on the activation step).
    assert run(no_warmup, [None, 1.0, 1.0, 1.0, 1.0, 1.0]) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert run(SAFSchedule(warmup_steps=None, anneal_steps=None), [None, 0.1, 5.0]) == [1.0, 1.0, 1.0]


def test_schedule_validation():
    for steps in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="warmup_steps to be an integer >= 1 or None"):
            SAFSchedule(warmup_steps=steps)
        with pytest.raises(ValueError, match="anneal_steps to be an integer >= 1 or None"):
            SAFSchedule(anneal_steps=steps)
        with pytest.raises(ValueError, match="anneal_total_steps to be an integer >= 1 or None"):
            SAFSchedule(anneal_total_steps=steps)
    for kl_drop in (-0.1, 1.5):
        with pytest.raises(ValueError, match="0 <= kl_drop <= 1"):
            SAFSchedule(kl_drop=kl_drop)
    for floor in (-0.1, 1.1):
        with pytest.raises(ValueError, match="0 <= floor <= 1"):
            SAFSchedule(floor=floor)
    schedule = SAFSchedule()
    with pytest.raises(RuntimeError, match="before the first update"):
        _ = schedule.scale
    for kl in (NAN, INF):
        with pytest.raises(ValueError, match="finite KL"):
            schedule.update(kl)
    assert schedule.step == 0  # a refused update does not count as a step


# KL_0 = 0.8 at step 2; it falls 25 % by step 5, so warm-up (W=6) ends early there; the anneal (R = 10 − 5) then
# runs to its floor.
KLS = [None, 0.8, 0.75, 0.7, 0.6, 0.65, 0.5, 0.4, 0.45, 0.3, 0.2, 0.2, 0.1]


@pytest.mark.parametrize("stop_after", [2, 5, 7, 12])  # mid-warm-up, at its end, mid-anneal, at the floor
def test_resume_is_exact(stop_after):
    settings = {"warmup_steps": 6, "kl_drop": 0.2, "anneal_steps": 50, "floor": 0.1, "anneal_total_steps": 10}
    uninterrupted = run(SAFSchedule(**settings), KLS)
    first = SAFSchedule(**settings)
    before = run(first, KLS[:stop_after])
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = SAFSchedule(**settings)
    resumed.load_state_dict(state)
    assert (resumed.step, resumed.warmup_end_step) == (first.step, first.warmup_end_step)
    assert before + run(resumed, KLS[stop_after:]) == uninterrupted
    assert uninterrupted[4:7] == pytest.approx([5 / 6, 5 / 6 * 0.82, 5 / 6 * 0.64])


def test_resume_refuses_changed_settings():
    schedule = SAFSchedule(warmup_steps=6)
    schedule.update(1.0)
    with pytest.raises(ValueError, match=r"settings differ.*anneal_steps: saved 200, now 50"):
        SAFSchedule(warmup_steps=6, anneal_steps=50).load_state_dict(schedule.state_dict())
