"""Skipped (non-finite) optimizer steps are counted and stop the run after too many in a row."""

from __future__ import annotations

import math

import pytest

from sapo_megatron.runtime.step_health import BadStepGuard, NonFiniteTrainingError

NAN = math.nan


def test_isolated_bad_steps_are_counted_and_tolerated():
    guard = BadStepGuard(max_in_a_row=2)
    seen = [
        guard.check(updated=u, loss=loss, grad_norm=g, phase="rl", step=i)
        for i, (u, loss, g) in enumerate(
            [(True, 1.0, 0.5), (False, NAN, NAN), (True, 1.0, 0.4), (False, 2.0, NAN)]
        )
    ]
    assert [m["train/update_skipped"] for m in seen] == [0.0, 1.0, 0.0, 1.0]
    assert seen[-1]["train/skipped_updates_total"] == 2.0


def test_too_many_in_a_row_stop_the_run_naming_the_step_and_the_fix():
    guard = BadStepGuard(max_in_a_row=3)
    guard.check(updated=False, loss=NAN, grad_norm=NAN, phase="sft", step=7)
    guard.check(
        updated=True, loss=math.inf, grad_norm=1.0, phase="sft", step=8
    )  # updated, but the loss says no
    with pytest.raises(NonFiniteTrainingError) as info:
        guard.check(updated=False, loss=NAN, grad_norm=NAN, phase="sft", step=9)
    assert "3 optimizer steps in a row" in str(info.value) and "sft step 9" in str(info.value)
    assert "trainer.max_bad_steps" in info.value.hint


def test_state_round_trip():
    guard = BadStepGuard(max_in_a_row=2)
    guard.check(updated=False, loss=NAN, grad_norm=NAN, phase="rl", step=1)
    resumed = BadStepGuard(max_in_a_row=2)
    resumed.load_state_dict(guard.state_dict())
    with pytest.raises(NonFiniteTrainingError):
        resumed.check(updated=False, loss=NAN, grad_norm=NAN, phase="rl", step=2)
