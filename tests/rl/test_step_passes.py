"""A new capability plugs into the RL step as one module and one line: the made-up reference-KL pass of
tests/rl/ref_kl_pass.py runs in every step after the reference pass, its part reaches the loss hook with every
micro-batch, and its metric reaches metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sapo_megatron.loop import trainer

ROOT = Path(__file__).resolve().parents[2]


def test_the_passes_are_registered_in_order():
    names = [f.__name__ for f in trainer.STEP_PASSES]
    assert names == [
        "staleness",
        "old_policy",
        "routing_agreement",
        "reference",
        "teacher_fusion",
        "rollout_corr_norm",
    ]


@pytest.mark.slow
def test_a_new_pass_runs_in_the_step_and_reaches_the_loss_hook_and_the_metrics(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = tmp_path / "run"
    subprocess.run(
        [sys.executable, "-m", "tests.rl.ref_kl_pass", str(run)], cwd=ROOT, env=env, check=True, timeout=600
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [row for row in rows if row["phase"] == "rl"]
    assert [row["step"] for row in rl] == [1, 2]
    seen = json.loads((run / "seen.json").read_text())
    assert seen and None not in seen  # every micro-batch the loss ran on carried the part
    # 2 steps × 2 updates × 1 micro-batch each: the hook's parts are the pass's, and the metric is their mean
    assert len(seen) == 4
    for row, parts in zip(rl, (seen[:2], seen[2:])):
        expected = sum(k for k, _ in parts) / sum(t for _, t in parts)
        assert row["test/ref_kl_old"] == pytest.approx(expected, rel=1e-12)
        assert row["test/ref_kl_old"] >= 0.0 and "kl/k3_ref" in row
