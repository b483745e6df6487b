"""Ctrl-C (SIGINT) during SFT and again during RL, each followed by ``--resume``, ends exactly where an
uninterrupted run ends: the same metrics at every step (bitwise), every (phase, step) logged once, one line per
interruption, exit code 130. Evaluation runs too (sampled, n 2, every 2 RL steps): its rows resume exactly too."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.rl.test_trainer import data_files, run_cli, train, write_config  # noqa: F401 - fixture reused

SIGNALLER = Path(__file__).with_name("signal_at_step.py")
COMPARED = {
    "sft": ("sft/nll", "grad_norm", "lr"),
    "rl": ("reward/mean", "loss/total", "loss/pg", "grad_norm", "entropy", "ratio/mean", "sapo/w_mean"),
    "eval": (
        "eval/heldout/avg@2",
        "eval/heldout/pass@2",
        "eval/heldout/maj@2",
        "eval/heldout/response_length_mean",
    ),
}


def config_for(tmp_path: Path, data_files) -> Path:  # noqa: F811
    return write_config(
        tmp_path / "run.yaml",
        data_files,
        **{"sft.steps": 8, "sft.log_every": 1, "trainer.steps": 5, "trainer.save_every": 0, "eval.every": 2},
        **{"eval.defaults": {"n": 2, "temperature": 1.0}},
    )


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def compared(run_dir: Path) -> dict[tuple[str, int], dict]:
    return {(r["phase"], r["step"]): {k: r[k] for k in COMPARED[r["phase"]]} for r in rows(run_dir)}


def interrupted(config: Path, at: str, *extra: str) -> subprocess.CompletedProcess:
    return run_cli(
        [str(SIGNALLER)], "train", str(config), *extra, env={"SAPO_TEST_SIGNAL_AT": at}, exit_code=130
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_files):  # noqa: F811
    config = config_for(tmp_path_factory.mktemp("straight"), data_files)
    train(config)
    return compared(config.parent / "run")


def test_sigint_in_sft_and_in_rl_then_resume_equals_a_straight_run(tmp_path, data_files, straight):  # noqa: F811
    config = config_for(tmp_path, data_files)
    run = tmp_path / "run"
    first = interrupted(config, "sft:3")
    lines = [line for line in first.stderr.splitlines() if line.startswith("sapo-megatron:")]
    assert lines == [  # at once: the signal was heard; at exit: where the run stopped and how to go on
        "sapo-megatron: SIGINT: stopping after the current step; signal again to exit at once",
        "sapo-megatron: interrupted at SFT step 3 of 8 (SIGINT); checkpoint written; "
        f"resume with: sapo-megatron train {config} --resume",
    ]
    assert "Traceback" not in first.stderr
    assert (run / "checkpoints" / "latest").read_text().strip() == "sft_000003"
    interrupted(config, "rl:2", "--resume")
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"
    train(config, "--resume")
    logged = [(r["phase"], r["step"]) for r in rows(run)]
    assert sorted(logged) == sorted(set(logged)) == sorted(straight)  # each (phase, step) exactly once
    assert compared(run) == straight
    assert [step for phase, step in sorted(straight) if phase == "eval"] == [0, 2, 4, 5]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["eval"]["step"] == 5
    assert (
        summary["eval_before"]["datasets"]["heldout"]["avg@2"] == straight[("eval", 0)]["eval/heldout/avg@2"]
    )
