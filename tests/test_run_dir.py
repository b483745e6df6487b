"""The output-directory policy: new / resume / auto / overwrite, refusals that touch nothing, failed starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sapo_megatron.checkpoint import atomic
from sapo_megatron.runtime.run_dir import (
    RunDirError,
    cleanup_failed_start,
    inspect_run_dir,
    prepare_run_dir,
)


def write_checkpoint(run_dir: Path, name: str, *, step: int, sft_step: int, latest: bool = True) -> Path:
    """A stand-in for ``dist_ckpt.save_train_state``: a directory with a complete train-state marker."""
    path = run_dir / "checkpoints" / name
    path.mkdir(parents=True)
    (path / "model.bin").write_bytes(b"weights")
    atomic.write_marker(path, "train_state", extra={"step": step, "sft_step": sft_step})
    if latest:
        atomic.update_latest(path)
    return path


def write_rows(run_dir: Path, rows: list[tuple[str, int]]) -> None:
    with (run_dir / "metrics.jsonl").open("a") as handle:
        for phase, step in rows:
            handle.write(json.dumps({"phase": phase, "step": step, "loss": 1.0}) + "\n")


def started_run(run_dir: Path) -> None:
    """What a start writes before its first step."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("name: run\n")
    (run_dir / "metrics.jsonl").write_text("")
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tensorboard" / "events.out.tfevents.1").write_bytes(b"\x00")
    (run_dir / "rollout_weights").mkdir()
    (run_dir / "rollout_weights" / "model.safetensors").write_bytes(b"w")


def run_with_checkpoint(run_dir: Path) -> Path:
    started_run(run_dir)
    write_rows(run_dir, [("sft", 10), ("rl", 1), ("rl", 2), ("rl", 3), ("rl", 4)])
    write_checkpoint(run_dir, "step_000002", step=2, sft_step=10)
    return write_checkpoint(run_dir, "step_000003", step=3, sft_step=10)


def unrelated(run_dir: Path) -> None:
    """Files a run never writes: they must survive every mode."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "notes.txt").write_text("mine\n")
    (run_dir / "slurm-42.out").write_text("job output\n")
    (run_dir / "train.log").write_text("earlier log\n")


def snapshot(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every path under ``root`` with its content (files) and modification time, to compare byte for byte."""
    result = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            content = path.read_bytes() if path.is_file() else None
            result[str(path.relative_to(root))] = (content, path.stat().st_mtime_ns)
    return result


# --------------------------------------------------------------------------------------------------------
# new
# --------------------------------------------------------------------------------------------------------


def test_new_creates_a_missing_directory(tmp_path):
    start = prepare_run_dir(tmp_path / "a" / "run", mode="new")
    assert (tmp_path / "a" / "run").is_dir()
    assert not start.resume and start.checkpoint is None and start.resume_at is None
    assert start.note is None


def test_new_starts_next_to_unrelated_files_and_keeps_them(tmp_path):
    unrelated(tmp_path)
    before = snapshot(tmp_path)
    start = prepare_run_dir(tmp_path, mode="new")
    assert not start.resume and start.note is None
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("with_checkpoint", [True, False])
def test_new_refuses_a_run_and_leaves_the_directory_untouched(tmp_path, with_checkpoint):
    unrelated(tmp_path)
    if with_checkpoint:
        run_with_checkpoint(tmp_path)
    else:
        started_run(tmp_path)
        write_rows(tmp_path, [("sft", 10), ("sft", 20)])
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError) as caught:
        prepare_run_dir(tmp_path, mode="new")
    text = f"{caught.value} {caught.value.hint}"
    assert "--resume" in text and "--overwrite" in text
    assert "already holds a run" in str(caught.value)
    assert ("step_000003" in text) == with_checkpoint
    assert "sft up to step 20" in text or with_checkpoint
    assert snapshot(tmp_path) == before


def test_new_removes_the_leftovers_of_a_failed_start(tmp_path):
    unrelated(tmp_path)
    keep = snapshot(tmp_path)
    started_run(tmp_path)
    (tmp_path / "config.yaml.tmp").write_text("half")
    start = prepare_run_dir(tmp_path, mode="new")
    assert not start.resume
    assert "never reached its first step" in start.note and "rollout_weights/" in start.note
    assert snapshot(tmp_path) == keep


def test_an_interrupted_removal_is_finished_by_the_next_start(tmp_path):
    unrelated(tmp_path)
    keep = snapshot(tmp_path)
    trash = tmp_path / ".sapo-removed-1-2"
    (trash / "checkpoints").mkdir(parents=True)
    (trash / "checkpoints" / "big.bin").write_bytes(b"x" * 100)
    prepare_run_dir(tmp_path, mode="new")
    assert snapshot(tmp_path) == keep


# --------------------------------------------------------------------------------------------------------
# resume
# --------------------------------------------------------------------------------------------------------


def test_resume_continues_from_latest_and_touches_nothing(tmp_path):
    latest = run_with_checkpoint(tmp_path)
    before = snapshot(tmp_path)
    start = prepare_run_dir(tmp_path, mode="resume")
    assert start.resume and start.checkpoint.path == latest
    assert start.resume_at == {"sft": 10, "rl": 3, "eval": 3}  # evaluations up to the checkpoint's RL step
    assert start.checkpoint.extra == {"step": 3, "sft_step": 10}
    assert "resuming from step_000003" in start.note
    assert snapshot(tmp_path) == before


def test_resume_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    run_with_checkpoint(tmp_path)
    (tmp_path / "checkpoints" / "latest").write_text("step_000009\n")  # names a checkpoint that is not there
    start = prepare_run_dir(tmp_path, mode="resume")
    assert start.checkpoint.path.name == "step_000003"
    assert "step_000009" in start.note and "latest" in start.note


def test_resume_of_nothing_says_so(tmp_path):
    unrelated(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError, match="nothing to resume") as caught:
        prepare_run_dir(tmp_path, mode="resume")
    assert "without --resume" in caught.value.hint
    assert snapshot(tmp_path) == before


def test_resume_of_a_run_without_checkpoint_names_what_is_there(tmp_path):
    started_run(tmp_path)
    write_rows(tmp_path, [("rl", 1), ("rl", 48)])
    (tmp_path / "checkpoints" / ".step_000100.partial").mkdir(parents=True)
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError) as caught:
        prepare_run_dir(tmp_path, mode="resume")
    message = str(caught.value)
    assert "stopped before its first checkpoint" in message
    assert "rl up to step 48" in message and ".step_000100.partial" in message
    assert "--overwrite" in caught.value.hint
    assert snapshot(tmp_path) == before


def test_resume_of_a_failed_start_says_to_start_again(tmp_path):
    started_run(tmp_path)
    with pytest.raises(RunDirError, match="before its first step") as caught:
        prepare_run_dir(tmp_path, mode="resume")
    assert "without --resume" in caught.value.hint


# --------------------------------------------------------------------------------------------------------
# auto
# --------------------------------------------------------------------------------------------------------


def test_auto_resumes_when_a_checkpoint_exists(tmp_path):
    latest = run_with_checkpoint(tmp_path)
    before = snapshot(tmp_path)
    start = prepare_run_dir(tmp_path, mode="auto")
    assert start.resume and start.checkpoint.path == latest and start.mode == "auto"
    assert snapshot(tmp_path) == before


def test_auto_starts_fresh_in_an_empty_directory(tmp_path):
    start = prepare_run_dir(tmp_path / "run", mode="auto")
    assert not start.resume and start.note is None


def test_auto_starts_an_unfinished_run_without_checkpoint_over(tmp_path):
    unrelated(tmp_path)
    keep = snapshot(tmp_path)
    started_run(tmp_path)
    write_rows(tmp_path, [("sft", 10)])
    start = prepare_run_dir(tmp_path, mode="auto")
    assert not start.resume
    assert "unfinished run without a checkpoint" in start.note and "starting over" in start.note
    assert snapshot(tmp_path) == keep


def test_auto_refuses_to_start_a_finished_run_over(tmp_path):
    started_run(tmp_path)
    write_rows(tmp_path, [("rl", 1)])
    (tmp_path / "summary.json").write_text("{}")
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError, match="finished run") as caught:
        prepare_run_dir(tmp_path, mode="auto")
    assert "--overwrite" in caught.value.hint
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------------------------------------
# overwrite
# --------------------------------------------------------------------------------------------------------


def test_overwrite_deletes_only_what_a_run_writes(tmp_path):
    unrelated(tmp_path)
    keep = snapshot(tmp_path)
    run_with_checkpoint(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / ".hf.partial").mkdir()
    start = prepare_run_dir(tmp_path, mode="overwrite")
    assert not start.resume and "removed the previous run" in start.note
    assert snapshot(tmp_path) == keep  # train.log, notes.txt, slurm-42.out, byte for byte
    assert inspect_run_dir(tmp_path).entries == ()


def test_overwrite_of_a_missing_directory_just_starts(tmp_path):
    start = prepare_run_dir(tmp_path / "run", mode="overwrite")
    assert not start.resume and start.note is None and (tmp_path / "run").is_dir()


def test_unknown_mode_and_a_file_as_directory(tmp_path):
    with pytest.raises(ValueError, match="mode must be one of"):
        prepare_run_dir(tmp_path, mode="continue")
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="is a file"):
        prepare_run_dir(tmp_path / "file", mode="new")


# --------------------------------------------------------------------------------------------------------
# failed starts
# --------------------------------------------------------------------------------------------------------


def test_a_start_that_fails_before_its_first_step_leaves_only_its_log(tmp_path):
    unrelated(tmp_path)
    keep = snapshot(tmp_path)
    start = prepare_run_dir(tmp_path, mode="new")
    with pytest.raises(FileNotFoundError), cleanup_failed_start(start):
        started_run(tmp_path)
        with (tmp_path / "train.log").open("a") as log:
            log.write("Traceback ...\n")
        raise FileNotFoundError("data.train: no such file")
    after = snapshot(tmp_path)
    assert after.pop("train.log")[0] == b"earlier log\nTraceback ...\n"
    keep.pop("train.log")
    assert after == keep
    assert prepare_run_dir(tmp_path, mode="new").note is None  # the next start finds nothing to clean


def test_a_run_that_logged_a_step_is_kept(tmp_path):
    start = prepare_run_dir(tmp_path, mode="new")
    with pytest.raises(RuntimeError), cleanup_failed_start(start):
        started_run(tmp_path)
        write_rows(tmp_path, [("sft", 10)])
        raise RuntimeError("boom")
    assert inspect_run_dir(tmp_path).holds_run
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "tensorboard").is_dir()


def test_a_failed_resume_never_touches_the_run_it_resumes(tmp_path):
    run_with_checkpoint(tmp_path)
    start = prepare_run_dir(tmp_path, mode="resume")
    before = snapshot(tmp_path)
    with pytest.raises(KeyboardInterrupt), cleanup_failed_start(start):
        (tmp_path / "rollout_weights" / "model.safetensors").write_bytes(b"rewritten")
        raise KeyboardInterrupt
    after = snapshot(tmp_path)
    assert after.pop("rollout_weights/model.safetensors")[0] == b"rewritten"
    before.pop("rollout_weights/model.safetensors")
    assert after == before
