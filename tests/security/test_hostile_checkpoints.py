"""Hostile checkpoint folders (issue 30, area "checkpoints"): damaged checkpoints, ``latest`` pointers that lead
elsewhere, and run entries that are links into another run. The run-directory policy answers them before torch
starts; nothing outside the run is followed or deleted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sapo_megatron.runtime.run_dir import check_run_dir, find_checkpoint, prepare_run_dir
from tests.security.hostile import case, expect
from tests.security.test_damaged_files import fake_train_state

AREA = "checkpoints"


def run_with_checkpoints(root: Path, steps=(1, 2)) -> Path:
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("name: run\n")
    rows = [{"phase": "rl", "step": s, "reward/mean": 0.5} for s in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step in steps:
        fake_train_state(run / "checkpoints", f"step_{step:06d}", step)
    return run


def truncate_all(run: Path) -> None:
    for shard in (run / "checkpoints").glob("step_*/__0_0.distcp"):
        with open(shard, "r+b") as handle:
            handle.truncate(100)


@pytest.mark.parametrize(
    ("cls", "mode", "words"),
    [
        case(
            AREA,
            "all checkpoints truncated, --resume",
            "CLEAR",
            "resume",
            "all 2 checkpoint(s) there are damaged",
        ),
        case(AREA, "same, --resume auto", "CLEAR", "auto", "all 2 checkpoint(s) there are damaged"),
    ],
)
def test_damaged_checkpoints_are_named_and_kept(tmp_path, cls, mode, words):
    run = run_with_checkpoints(tmp_path)
    truncate_all(run)
    err = expect(cls, lambda: check_run_dir(run, mode=mode), words)
    assert "step_000001, step_000002" in str(err) and "bytes, the save wrote 4096" in str(err)
    assert "--overwrite" in err.hint and sorted(p.name for p in (run / "checkpoints").iterdir())[:2] == [
        "latest",
        "step_000001",
    ]


@pytest.mark.parametrize(
    ("cls", "pointer", "words"),
    [
        case(AREA, "latest -> symlink to /etc/hostname", "CLEAR", "LINK", "latest"),
        case(AREA, "latest holds ../../ path", "CLEAR", "../../other/run/checkpoints/step_000001", "latest"),
    ],
)
def test_latest_pointers_that_lead_elsewhere(tmp_path, cls, pointer, words):
    run = run_with_checkpoints(tmp_path, steps=())
    run_with_checkpoints(tmp_path / "other")  # a complete checkpoint outside this run
    latest = run / "checkpoints" / "latest"
    if pointer == "LINK":
        (tmp_path / "hostname").write_text("buildhost\n")
        latest.symlink_to(tmp_path / "hostname")
    else:
        assert (latest.parent / pointer / "sapo_checkpoint.json").is_file()  # it does lead to one
        latest.write_text(pointer + "\n")
    found, _ = find_checkpoint(run / "checkpoints")
    assert found is None  # never a checkpoint outside checkpoints/
    expect(cls, lambda: check_run_dir(run, mode="resume"), words)


@pytest.mark.parametrize(
    ("cls",),
    [case(AREA, "--overwrite with checkpoints/ tensorboard/ symlinked to another run", "OK")],
)
def test_overwrite_removes_links_not_what_they_point_to(tmp_path, cls):
    other = run_with_checkpoints(tmp_path / "other")
    (other / "tensorboard").mkdir()
    (other / "tensorboard" / "events").write_text("e")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"phase": "rl", "step": 1}) + "\n")
    (run / "checkpoints").symlink_to(other / "checkpoints")
    (run / "tensorboard").symlink_to(other / "tensorboard")
    start = expect(cls, lambda: prepare_run_dir(run, mode="overwrite"))
    assert start.checkpoint is None and not (run / "checkpoints").exists()
    assert (other / "tensorboard" / "events").read_text() == "e"
    assert find_checkpoint(other / "checkpoints")[0].path.name == "step_000002"
