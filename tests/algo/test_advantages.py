"""Group advantages, dynamic-sampling filter and DAPO overlong penalty against hand values."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from sapo_megatron.algo import AdvantageConfig, grpo_advantages, nonconstant_groups, overlong_penalty

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])


def test_grpo_advantages_hand_values():
    # group 0: mean 0.5, sample std sqrt(4·0.25/3) = 1/√3; group 2: mean 0.25, sample std sqrt(0.75/3) = 0.5
    expected = torch.tensor(
        [[0.5 * 3**0.5, -0.5 * 3**0.5, -0.5 * 3**0.5, 0.5 * 3**0.5], [0.0] * 4, [-0.5, -0.5, -0.5, 1.5]]
    )
    torch.testing.assert_close(grpo_advantages(REWARDS), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(AdvantageConfig().compute(REWARDS), expected, rtol=1e-5, atol=1e-5)


def test_drgrpo_advantages_only_centre():
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [-0.25, -0.25, -0.25, 0.75]])
    torch.testing.assert_close(grpo_advantages(REWARDS, std_normalize=False), expected)
    torch.testing.assert_close(AdvantageConfig(name="drgrpo").compute(REWARDS), expected)


def test_eps_changes_grpo_and_is_refused_for_drgrpo():
    small = grpo_advantages(REWARDS, eps=1e-6)[2, 3].item()
    large = AdvantageConfig(eps=0.5).compute(REWARDS)[2, 3].item()
    assert (small, large) == pytest.approx((0.75 / 0.5, 0.75 / 1.0), rel=1e-5)
    with pytest.raises(ValidationError, match="eps only applies"):
        AdvantageConfig(name="drgrpo", eps=0.1)


def test_constant_group_gives_exactly_zero():
    adv = grpo_advantages(torch.full((2, 8), 0.7))
    assert (adv == 0).all()


def test_nonconstant_groups():
    assert nonconstant_groups(REWARDS).tolist() == [True, False, True]
    assert nonconstant_groups(torch.tensor([[0.0, 0.0], [-1.0, -1.0], [0.0, 1e-3]])).tolist() == [
        False,
        False,
        True,
    ]


def test_overlong_penalty_boundaries():
    # L_max = 10, L_cache = 4: free up to 6, linear to -1 at 10, -1 beyond
    lengths = torch.tensor([0, 6, 7, 8, 9, 10, 11, 100])
    expected = [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert overlong_penalty(lengths, max_len=10, cache_len=4).tolist() == pytest.approx(expected)


def test_bad_inputs():
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, cache_len=5)
    with pytest.raises(ValueError, match="num_groups, group_size"):
        grpo_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="group_size >= 2"):
        grpo_advantages(torch.ones(3, 1))
    assert (grpo_advantages(torch.ones(3, 1), std_normalize=False) == 0).all()
