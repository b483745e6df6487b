"""A real compare of the tiny demo (2 arms × 3 RL steps from a 20-step warm start), killed during its second arm
(SIGKILL to the compare and the arm at once), run again (only the missing arm runs, then the report), and run
a third time (nothing runs, the report is written again)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARMS = ("sapo-none-none-s0", "grpo-none-none-s0")
TINY = [
    "--losses", "sapo,grpo", "--replay", "none", "--steps", "3",
    "--set", "sft.steps=20", "--set", "sft.global_batch=16", "--set", "data.train_size=64",
    "--set", "eval.datasets.0.size=16", "--set", "trainer.prompts_per_step=4", "--set", "rollout.n_samples=4",
    "--set", "trainer.mini_batches=1", "--set", "eval.every=0", "--set", "trainer.save_every=0",
    "--set", "trainer.export_hf=false",
]  # fmt: skip
PLOTS = {"reward", "accuracy", "entropy", "mismatch_k3", "routing_agreement", "grad_norm", "reverse_kl"}
# the policy diagnostics, and the demo's one eval dataset
PLOTS |= {"ratio_tails", "kl_old", "sapo_gate", "eval_heldout"}
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def compare_command(root: Path) -> list[str]:
    return [sys.executable, "-m", "sapo_megatron.cli", "compare", *TINY, "--output-dir", str(root)]


def rl_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["phase"] == "rl"]


def kill_during_second_arm(root: Path, console: Path) -> None:
    """Start the compare in its own process group; SIGKILL the group once the second arm's run has started."""
    with console.open("w") as out:
        proc = subprocess.Popen(
            compare_command(root), stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
        )
    deadline = time.monotonic() + 240
    while not (root / ARMS[1] / "config.yaml").exists():
        assert proc.poll() is None, console.read_text()[-3000:]
        assert time.monotonic() < deadline, "the second arm never started"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the group this test created: the compare and its running arm
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare") / "cmp"
    console = root.parent / "killed.txt"
    kill_during_second_arm(root, console)
    after_kill = {
        "finished": [(root / arm / "summary.json").exists() for arm in ARMS],
        "first_summary_mtime": (root / ARMS[0] / "summary.json").stat().st_mtime_ns,
        "report": (root / "report.json").exists(),
        "console": console.read_text(),
    }
    second = subprocess.run(compare_command(root), capture_output=True, text=True, env=ENV, timeout=300)
    report_mtime = (root / "report.json").stat().st_mtime_ns if second.returncode == 0 else None
    third = subprocess.run(compare_command(root), capture_output=True, text=True, env=ENV, timeout=300)
    return root, after_kill, second, report_mtime, third


def test_the_kill_left_the_first_arm_finished_and_the_second_not(runs):
    _, after_kill, *_ = runs
    assert after_kill["finished"] == [True, False], after_kill["console"]
    assert not after_kill["report"]
    assert "[1/2] sapo-none-none-s0 ... done in" in after_kill["console"]


def test_the_rerun_runs_only_the_missing_arm_and_writes_the_report(runs):
    root, after_kill, second, *_ = runs
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    lines = second.stdout.splitlines()
    assert "warm start (20 SFT steps) ... finished earlier" in lines
    assert any(line.startswith("[1/2] sapo-none-none-s0 ... finished earlier: reward ") for line in lines)
    assert any(line.startswith("[2/2] grpo-none-none-s0 ... done in ") for line in lines)
    assert (root / ARMS[0] / "summary.json").stat().st_mtime_ns == after_kill["first_summary_mtime"]
    report = json.loads((root / "report.json").read_text())
    assert [(arm["loss"], arm["replay"], arm["correction"], arm["seed"]) for arm in report["arms"]] == [
        ("sapo", "none", "none", 0),
        ("grpo", "none", "none", 0),
    ]
    for arm in report["arms"]:
        assert arm["steps"] == 3 and isinstance(arm["final"]["collapsed"], bool)
        assert 0.0 <= arm["final"]["accuracy"] <= 1.0 and arm["final"]["entropy"] > 0
        assert arm["eval"]["heldout"]["after"] == arm["final"]["accuracy"]
        assert arm["eval"]["heldout"]["before"] is not None and arm["final"]["ratio_max"] >= 1.0
    sapo, grpo = (arm["final"] for arm in report["arms"])
    # the diagnostics each loss logs: SAPO no clip fraction, GRPO no gate (this 3-step world rewards nothing, so
    # no token has a positive or negative advantage and SAPO's per-sign gate means are not measured either)
    assert sapo["clip_frac"] is None and sapo["kl_old"] is not None and sapo["gate_seq_std"] is not None
    assert grpo["clip_frac"] is not None and grpo["gate_seq_std"] is None and grpo["gate_w_pos"] is None
    assert {path.stem for path in (root / "plots").glob("*.png")} == PLOTS
    assert all(0 < path.stat().st_size < 150_000 for path in (root / "plots").glob("*.png"))
    assert "## Collapse rule" in (root / "report.md").read_text()


def test_both_arms_start_from_the_warm_start_with_the_same_data(runs):
    root, *_ = runs
    first, second = (rl_rows(root / arm) for arm in ARMS)
    # Same initial weights, prompts and sampling seed: the first rollout (reward) and the first forward
    # (entropy, before any update) are the same in both arms; only the loss differs.
    assert first[0]["reward/mean"] == second[0]["reward/mean"]
    assert first[0]["entropy"] == second[0]["entropy"]
    summaries = [json.loads((root / arm / "summary.json").read_text()) for arm in ARMS]
    assert summaries[0]["accuracy_before"] == summaries[1]["accuracy_before"]
    assert summaries[0]["sft_steps"] == summaries[1]["sft_steps"] == 0
    assert (root / "warm_start" / "hf" / "config.json").is_file()


def test_a_third_run_skips_both_arms_and_rewrites_the_report(runs):
    root, _, _, report_mtime, third = runs
    assert third.returncode == 0, third.stderr[-3000:]
    assert third.stdout.count("finished earlier") == 3  # the warm start and both arms
    assert "done in" not in third.stdout
    assert (root / "report.json").stat().st_mtime_ns > report_mtime
