"""GRPO, GSPO and each baseline loss train two RL steps of the embedded demo (after test_trainer's 40 SFT steps), with a
verl-style rollout correction composed on some, and packing or R2/R3 routing replay (fp8 rollout) on others: the
run finishes, every step's loss is finite and non-zero, the policy moves, and the loss's diagnostics are logged."""

from __future__ import annotations

import math

import pytest

from tests.rl.test_routing_replay_loop import ROUTED, rl_rows
from tests.rl.test_trainer import data_files, train, write_config  # noqa: F401 - fixture reused

RUNS = {
    "grpo": (
        {"name": "grpo"},
        {"name": "rollout_corr", "is_level": "token", "is_threshold": 2.0, "is_batch_normalize": True},
        "clip/frac",
    ),
    "gspo": ({"name": "gspo"}, {"name": "none"}, "clip/frac"),
    "cispo": (
        {"name": "cispo"},
        {"name": "rollout_corr", "is_level": "token", "is_threshold": 2.0},
        "clip/frac",
    ),
    "gmpo": ({"name": "gmpo"}, {"name": "rollout_corr", "is_level": "sequence"}, "clip/frac"),
    "dppo_tv": ({"name": "dppo_tv"}, {"name": "none"}, "clip/frac"),
    "dppo_kl": (
        {"name": "dppo_kl"},
        {
            "name": "rollout_corr",
            "is_level": None,
            "reject": [{"stat": "seq_mean_k1", "lower": 0.9, "upper": 1.1}],
        },
        "clip/frac",
    ),
    "m2po": ({"name": "m2po"}, {"name": "tis"}, "m2po/frac_masked"),
}
FP8_ROUTES = {k: v for k, v in ROUTED.items() if k.startswith("rollout.")}  # its steps are this test's
EXTRA = {  # the features the baselines must compose with besides corrections: packing (GMPO's sequence ratio
    # over packed rows) and routing replay (R3 replays the engine's routes in DPPO's and M2PO's updates); the
    # fp8 rollout gives GRPO's batch-normalised correction a mismatch to normalise
    "grpo": {"rollout.precision": "fp8"},
    "gmpo": {"parallel.max_tokens_per_micro_batch": 48},
    "dppo_tv": {**FP8_ROUTES, "algorithm.routing_replay": "r3"},
    "m2po": {**FP8_ROUTES, "algorithm.routing_replay": "r2"},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_two_rl_steps(tmp_path, data_files, name):  # noqa: F811
    loss, correction, diagnostic = RUNS[name]
    overrides = {
        "trainer.steps": 2,
        "algorithm.loss": loss,
        "algorithm.correction": correction,
        **EXTRA.get(name, {}),
    }
    train(write_config(tmp_path / "run.yaml", data_files, **overrides))
    rows = rl_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["loss/total"]) and row["loss/total"] != 0
        assert math.isfinite(row["grad_norm"])
        assert 0 <= row[diagnostic] <= 1
        replay = EXTRA.get(name, {}).get("algorithm.routing_replay")
        if replay is not None:
            assert row["routing/agreement"] < 1.0  # the fp8 engine routes some tokens differently
            # R3 trains on the engine's routes; R2 on the old-log-prob pass's, which agree with the engine as live.
            used = 1.0 if replay == "r3" else pytest.approx(row["routing/agreement"], abs=1e-12)
            assert row["routing/agreement_used"] == used
        if correction["name"] == "rollout_corr":
            assert 0 <= row["rollout_corr/rejected_frac"] <= 1 and row["rollout_corr/weight_mean"] >= 0
        if correction.get("is_batch_normalize"):
            # divided by the step's mean: the mean weight over the step's tokens is 1, the divisor is not
            assert row["rollout_corr/weight_mean"] == pytest.approx(1.0, abs=1e-5)
            assert row["rollout_corr/batch_norm_factor"] > 0
            assert row["rollout_corr/batch_norm_factor"] != pytest.approx(1.0, abs=1e-9)
    # The loss moved the policy: a gradient, and the second mini-batch's ratios are no longer all 1.
    assert max(r["grad_norm"] for r in rows) > 0
    assert any(r["mb1/ratio/mean"] != 1.0 for r in rows)
