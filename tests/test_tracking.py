"""Tracker: every (phase, step) once after a resume (metrics.jsonl and TensorBoard), tags as named, non-finite
values kept, progress bars that count steps."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sapo_megatron.runtime.tracking import Tracker, truncate_metrics


def rows(run_dir: Path) -> list[dict]:
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def scalars(run_dir: Path, phase: str) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows for run ``phase``: tag -> [(step, value)] after its purge logic."""
    acc = EventAccumulator(str(run_dir / "tensorboard" / phase))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def log_run(tracker: Tracker, phase: str, steps: range, offset: float = 0.0) -> None:
    for step in steps:
        name = "sft/nll" if phase == "sft" else "loss/total"
        tracker.log(step, {name: step + offset, "grad_norm": 0.5 * step + offset}, phase=phase)


def test_a_resumed_run_logs_every_phase_and_step_once(tmp_path):
    first = Tracker(tmp_path, enabled=True)
    log_run(first, "sft", range(1, 6))
    log_run(first, "rl", range(1, 11))  # the run dies after RL step 10; its checkpoint is at step 6
    first.close()
    time.sleep(1.1)  # event files are ordered by the second in their names, as between two real processes
    resumed = Tracker(tmp_path, enabled=True, resume_at={"sft": 5, "rl": 6})
    log_run(resumed, "rl", range(7, 11), offset=100.0)
    resumed.close()

    logged = [(row["phase"], row["step"]) for row in rows(tmp_path)]
    assert logged == [("sft", s) for s in range(1, 6)] + [("rl", s) for s in range(1, 11)]
    rl_rows = [row for row in rows(tmp_path) if row["phase"] == "rl"]
    assert [row["loss/total"] for row in rl_rows] == [1, 2, 3, 4, 5, 6, 107, 108, 109, 110]

    rl = scalars(tmp_path, "rl")
    assert sorted(rl) == ["grad_norm", "loss/total"]
    assert rl["loss/total"] == [(s, float(s)) for s in range(1, 7)] + [(s, s + 100.0) for s in range(7, 11)]
    assert [step for step, _ in rl["grad_norm"]] == list(range(1, 11))
    sft = scalars(tmp_path, "sft")  # the other phase's writer is untouched by the RL purge
    assert sft["sft/nll"] == [(s, float(s)) for s in range(1, 6)]


def test_tags_are_the_metric_names_and_phases_are_runs(tmp_path):
    tracker = Tracker(tmp_path, enabled=True)
    tracker.log(1, {"sft/nll": 2.0, "lr": 1e-3}, phase="sft")
    tracker.log(1, {"reward/mean": 0.5}, phase="rl")
    tracker.close()
    assert sorted(p.name for p in (tmp_path / "tensorboard").iterdir()) == ["rl", "sft"]
    assert sorted(scalars(tmp_path, "sft")) == ["lr", "sft/nll"]  # not sft/sft/nll
    assert sorted(scalars(tmp_path, "rl")) == ["reward/mean"]


def test_non_finite_values_are_written_as_null_and_counted(tmp_path):
    tracker = Tracker(tmp_path, enabled=True)
    assert tracker.log(1, {"loss/total": math.nan, "grad_norm": math.inf, "lr": 1e-3}, phase="rl") == [
        "loss/total",
        "grad_norm",
    ]
    assert tracker.log(2, {"loss/total": 1.0, "grad_norm": None}, phase="rl") == []  # None: no value
    tracker.log(3, {"loss/total": -math.inf}, phase="rl")
    tracker.close()
    assert rows(tmp_path) == [
        {"phase": "rl", "step": 1, "loss/total": None, "grad_norm": None, "lr": 1e-3},
        {"phase": "rl", "step": 2, "loss/total": 1.0, "grad_norm": None},
        {"phase": "rl", "step": 3, "loss/total": None},
    ]
    assert tracker.nonfinite_rows == {"rl": 2}
    loss = scalars(tmp_path, "rl")["loss/total"]
    assert [step for step, _ in loss] == [1, 2, 3] and math.isnan(loss[0][1]) and loss[2][1] == -math.inf


def test_numbers_of_any_kind_and_a_clear_error_for_others(tmp_path):
    tracker = Tracker(tmp_path, enabled=True, tensorboard=False)
    tracker.log(1, {"a": np.float32(0.5), "b": torch.tensor(2.0), "c": True, "d": np.int64(3)}, phase="rl")
    with pytest.raises(TypeError, match="metric 'e': expected a number, got str"):
        tracker.log(2, {"e": "high"}, phase="rl")
    tracker.close()
    assert rows(tmp_path) == [{"phase": "rl", "step": 1, "a": 0.5, "b": 2.0, "c": 1.0, "d": 3.0}]
    assert not (tmp_path / "tensorboard").exists()


def test_the_progress_bar_counts_steps_not_log_calls(tmp_path, capsys):
    tracker = Tracker(tmp_path, enabled=True, tensorboard=False)
    tracker.start_phase("sft", 40)
    for step in (10, 20, 30, 40):  # sft.log_every = 10
        tracker.log(step, {"sft/nll": 1.0}, phase="sft")
    tracker.close_phase()
    tracker.start_phase("rl", 8, initial=5)  # a resume at step 5
    tracker.log(6, {"reward/mean": 0.25}, phase="rl")
    tracker.close()
    # what a terminal shows: of each line, the part after its last carriage return
    final_lines = [line.rsplit("\r", 1)[-1] for line in capsys.readouterr().out.split("\n") if line]
    assert final_lines[0].startswith("sft: 100%") and "40/40" in final_lines[0], final_lines
    assert (
        final_lines[1].startswith("rl:  75%") and "6/8" in final_lines[1] and "reward=0.25" in final_lines[1]
    )


def test_truncate_metrics_keeps_other_phases_and_drops_torn_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"phase": "sft", "step": s} for s in (10, 20, 30)] + [
        {"phase": "rl", "step": s} for s in (1, 2, 3)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in lines) + '{"phase": "rl", "st')
    assert truncate_metrics(path, {"rl": 2}) == 2
    assert [json.loads(line) for line in path.read_text().splitlines()] == lines[:5]
    before = path.stat()
    assert truncate_metrics(path, {"rl": 2, "sft": 30}) == 0
    assert path.stat().st_ino == before.st_ino  # nothing to drop: not rewritten


def test_a_disabled_tracker_writes_nothing(tmp_path):
    tracker = Tracker(tmp_path / "run", enabled=False, resume_at={"rl": 1})
    tracker.start_phase("rl", 3)
    assert tracker.log(1, {"loss/total": math.nan}, phase="rl") == []
    tracker.message("hello")
    tracker.close()
    assert not (tmp_path / "run").exists()
