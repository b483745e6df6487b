"""SAF stages on hand-made numbers: sparsify (count, ties, masks), compress, and the warm-up/anneal schedule."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sapo_megatron.algo import SAFSchedule, saf_compress, saf_keep_mask, saf_sparsify

NAN, INF = float("nan"), float("inf")


def test_sparsify_hand_example_with_ties_and_different_lengths():
    adv = torch.tensor(
        [
            # n=5, keep 0.2 -> 1 token; |−2| and |2| tie: the earlier one (position 1) wins. Padding (9) ignored.
            [0.5, -2.0, 2.0, 0.1, -0.5, 9.0, 9.0, 9.0],
            # prompt (5.0) ignored; n=7 -> ceil(1.4) = 2 tokens; five tokens tie at |0.3|: positions 1 and 3 win.
            [5.0, 0.3, 0.1, -0.3, 0.2, 0.3, 0.3, 0.3],
            # no response tokens: stays zero whatever the values.
            [4.0, -4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            # n=8 -> 2 tokens, no ties: the two largest |adv|.
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
            [0.0, -2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.3, 0.0, -0.3, 0.0, 0.0, 0.0, 0.0],
            [0.0] * 8,
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.7, -0.8],
        ]
    )
    assert torch.equal(saf_sparsify(adv, mask, keep=0.2), expected)
    assert saf_keep_mask(adv, mask, keep=0.2).sum(-1).tolist() == [1, 2, 0, 2]


@pytest.mark.parametrize(
    ("n", "keep", "kept"),
    [
        (7, 0.2, 2),  # ceil(1.4)
        (5, 0.2, 1),  # exactly 1.0
        (5, 0.5, 3),  # ceil(2.5)
        (3, 0.01, 1),  # ceil(0.03)
        (3, 1e-10, 1),  # at least one, even where keep · n is below float slack
        (100, 0.07, 7),  # 0.07 · 100 is 7.000000000000001 in floats: still 7, not 8
        (6, 1.0, 6),  # keep=1 keeps every response token
    ],
)
def test_sparsify_count_is_ceil_of_keep_n(n, keep, kept):
    adv = torch.arange(1.0, n + 1.0)[None]  # distinct values: the largest `kept` survive
    out = saf_sparsify(adv, torch.ones(1, n), keep=keep)
    assert int((out != 0).sum()) == kept
    assert out[0, n - kept :].tolist() == adv[0, n - kept :].tolist()


def test_sparsify_ties_go_to_earlier_tokens_in_long_rows():
    # Long rows take other sort code paths; the earliest tied tokens must still win.
    adv = torch.tensor([[0.5, -1.0] * 50])
    kept = saf_keep_mask(adv, torch.ones(1, 100), keep=0.2)  # 20 tokens among the 50 tied at |1.0|
    assert kept.nonzero()[:, 1].tolist() == list(range(1, 40, 2))


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
    assert run(schedule, [1.0] * 6) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert schedule.warmup_ended and schedule.warmup_end_step == 4


def test_warmup_stops_early_when_kl_drops_and_freezes_the_scale():
    schedule = SAFSchedule(warmup_steps=10, kl_drop=0.2, anneal_steps=None)
    # 0.81 is a 19 % drop (not enough); 0.79 is 21 %: warm-up ends at step 4 with scale 0.4, and stays there
    # even when the KL rises again.
    assert run(schedule, [1.0, 0.9, 0.81, 0.79, 0.5, 2.0]) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])
    assert schedule.warmup_end_step == 4
    assert (schedule.scale, schedule.coef, schedule.multiplier) == pytest.approx((0.4, 1.0, 0.4))
    # kl_drop is the threshold: with 0.1 the 19 % drop at step 3 already ends warm-up.
    assert run(SAFSchedule(warmup_steps=10, kl_drop=0.1, anneal_steps=None), [1.0, 0.9, 0.81, 0.79]) == (
        pytest.approx([0.1, 0.2, 0.2, 0.2])
    )


def test_no_early_stop_without_a_positive_first_kl():
    schedule = SAFSchedule(warmup_steps=3, anneal_steps=None)
    assert run(schedule, [0.0, -0.5, 0.0, 0.0]) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    assert schedule.warmup_end_step == 3


def test_anneal_after_warmup_and_floor():
    kls = [1.0] * 7
    assert run(SAFSchedule(warmup_steps=2, anneal_steps=4), kls) == pytest.approx(
        [0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    )
    floored = SAFSchedule(warmup_steps=2, anneal_steps=4, floor=0.2)
    assert run(floored, kls) == pytest.approx([0.5, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    assert (floored.scale, floored.coef) == pytest.approx((1.0, 0.2))


def test_anneal_starts_at_the_early_stop_with_the_frozen_scale():
    schedule = SAFSchedule(warmup_steps=10, anneal_steps=2)
    assert run(schedule, [1.0, 0.5, 0.5, 0.5, 0.5]) == pytest.approx([0.1, 0.2, 0.1, 0.0, 0.0])
    assert schedule.warmup_end_step == 2


def test_stages_switched_off():
    no_warmup = SAFSchedule(warmup_steps=None, anneal_steps=4)
    assert no_warmup.warmup_ended and no_warmup.warmup_end_step == 0
    assert run(no_warmup, [1.0] * 5) == pytest.approx([0.75, 0.5, 0.25, 0.0, 0.0])
    assert run(SAFSchedule(warmup_steps=None, anneal_steps=None), [1.0, 0.1, 5.0]) == [1.0, 1.0, 1.0]


def test_schedule_validation():
    for steps in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="warmup_steps to be an integer >= 1 or None"):
            SAFSchedule(warmup_steps=steps)
        with pytest.raises(ValueError, match="anneal_steps to be an integer >= 1 or None"):
            SAFSchedule(anneal_steps=steps)
    for kl_drop in (0.0, 1.5):
        with pytest.raises(ValueError, match="0 < kl_drop <= 1"):
            SAFSchedule(kl_drop=kl_drop)
    for floor in (-0.1, 1.1):
        with pytest.raises(ValueError, match="0 <= floor <= 1"):
            SAFSchedule(floor=floor)
    schedule = SAFSchedule()
    with pytest.raises(RuntimeError, match="before the first update"):
        _ = schedule.scale
    for kl in (NAN, INF):
        with pytest.raises(ValueError, match="finite reverse KL"):
            schedule.update(kl)
    assert schedule.step == 0  # a refused update does not count as a step


# KL falls 25 % by step 4, so warm-up (W=6) ends early there; the anneal (R=5) then runs to its floor.
KLS = [0.8, 0.75, 0.7, 0.6, 0.65, 0.5, 0.4, 0.45, 0.3, 0.2, 0.2, 0.1]


@pytest.mark.parametrize("stop_after", [2, 4, 7, 11])  # mid-warm-up, at its end, mid-anneal, at the floor
def test_resume_is_exact(stop_after):
    settings = {"warmup_steps": 6, "kl_drop": 0.2, "anneal_steps": 5, "floor": 0.1}
    uninterrupted = run(SAFSchedule(**settings), KLS)
    first = SAFSchedule(**settings)
    before = run(first, KLS[:stop_after])
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = SAFSchedule(**settings)
    resumed.load_state_dict(state)
    assert (resumed.step, resumed.warmup_end_step) == (first.step, first.warmup_end_step)
    assert before + run(resumed, KLS[stop_after:]) == uninterrupted
    assert uninterrupted[3:6] == pytest.approx([4 / 6, 4 / 6 * 0.82, 4 / 6 * 0.64])


def test_resume_refuses_changed_settings():
    schedule = SAFSchedule(warmup_steps=6)
    schedule.update(1.0)
    with pytest.raises(ValueError, match=r"settings differ.*anneal_steps: saved 200, now 50"):
        SAFSchedule(warmup_steps=6, anneal_steps=50).load_state_dict(schedule.state_dict())
