"""Packing in the RL loop: with ``parallel.max_tokens_per_micro_batch`` the whole run (SFT warm start, old-log-prob
pass, R3 replay of the engine's routes, routing and mismatch metrics, the policy updates) logs the same
numbers as the padded run, step by step."""

from __future__ import annotations

import pytest

from tests.rl.test_routing_replay_loop import rl_rows
from tests.rl.test_trainer import data_files, train, write_config  # noqa: F401 - fixture reused

RUN = {
    "rollout.routed_experts": True,
    "algorithm.routing_replay": "r3",
    "trainer.steps": 2,
    "sft.steps": 4,
}
COMPARED = (
    "reward/mean",
    "loss/total",
    "grad_norm",
    "mismatch/k3",
    "ratio/mean",
    "routing/agreement",
    "routing/agreement_used",
)
# The two runs part by summation order only, but Adam (which divides tiny gradient differences by tiny second
# moments, through the SFT steps and each RL update) amplifies that; step 1 is held to 1e-5 relative, step 2, after
# one more update and new rollouts, to 1e-3 (absolute 1e-8: mismatch/k3 is a squared difference of nearly equal
# log-probs).
RTOL = {1: 1e-5, 2: 1e-3}


def test_packed_run_logs_the_padded_run(tmp_path, data_files):  # noqa: F811
    rows = {}
    for name, budget in (("padded", None), ("packed", 48)):
        (tmp_path / name).mkdir()
        config = write_config(
            tmp_path / name / "run.yaml", data_files, **RUN, **{"parallel.max_tokens_per_micro_batch": budget}
        )
        train(config)
        rows[name] = rl_rows(tmp_path / name / "run")
    assert len(rows["packed"]) == len(rows["padded"]) == 2
    for padded, packed in zip(rows["padded"], rows["packed"]):
        assert padded["routing/agreement_used"] == packed["routing/agreement_used"] == 1.0
        for key in COMPARED:
            assert packed[key] == pytest.approx(padded[key], rel=RTOL[padded["step"]], abs=1e-8), (
                padded["step"],
                key,
            )
    # and it did pack: another computation, not bitwise the padded one (the demo's sequences all have about the
    # same length, so train/padding_frac can come out equal: 64 sequences × 12 tokens = 16 packed rows × 48)
    assert any(
        p[k] != q[k] for p, q in zip(rows["padded"], rows["packed"]) for k in ("loss/total", "grad_norm")
    )
