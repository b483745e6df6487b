"""docs/coming_from.md's worked examples (issue 29, item 7): each example config – verl's parquet and reward,
slime's keys, TRL's dataset and reward – passes ``--dry-run`` and trains a few steps on the tiny model; a run
scores with the user's own reward (no error), and the verl example's SFT target is in the reward's format."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "coming_from.md"

pytestmark = pytest.mark.slow


def examples() -> list[str]:
    return sorted(set(re.findall(r"sapo-megatron train (configs/coming_from/\w+\.yaml)", DOC.read_text())))


def sapo(*args: str) -> subprocess.CompletedProcess:
    """The CLI from the repository root, as the page's commands run."""
    proc = subprocess.run(
        [sys.executable, "-m", "sapo_megatron.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_the_page_has_one_example_per_project():
    assert examples() == [
        "configs/coming_from/slime_math.yaml",
        "configs/coming_from/trl_grpo.yaml",
        "configs/coming_from/verl_gsm8k.yaml",
    ]


@pytest.mark.parametrize("config", examples())
def test_example_dry_runs_and_trains(config, tmp_path):
    dry = sapo("train", config, "--dry-run")
    assert "data OK: every row of the prompt data is usable" in dry.stdout
    out = tmp_path / "run"
    short = ("--set", "sft.steps=4", "--set", "trainer.steps=2", "--set", "eval.every=1")
    sapo("train", config, "--set", f"output_dir={out}", *short)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["reward_errors"] == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [1, 2]
    assert (
        "none of the first" not in (out / "train.log").read_text()
    )  # the SFT targets score under the reward
