"""Exact resume: N steps straight equal N/2 + resume + N/2 (same rewards, losses, gradient norms, bitwise),
also when the process dies while writing a checkpoint. The runs distil from a teacher with SAF, whose schedule
(warm-up over 2 steps, anneal over 6) is mid-way at the resume point: its checkpointed state must come back too."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distill.models import make_teacher
from tests.rl.test_trainer import data_files, train, write_config  # noqa: F401 - fixture reused

COMPARED = (
    "reward/mean",
    "loss/total",
    "loss/pg",
    "grad_norm",
    "entropy",
    "ratio/mean",
    "sapo/w_mean",
    "opd/reverse_kl",
    "saf/multiplier",
    "saf/coef",
    "opd/student_teacher_k3",
)
SAF = {"mode": "saf", "warmup": {"steps": 2}, "anneal": {"steps": 6}}
CRASHER = Path(__file__).with_name("crash_in_save.py")


def rl_rows(run_dir: Path) -> dict[int, dict]:
    """The last logged row of each RL step (a resumed run logs again the steps after its checkpoint)."""
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["phase"] == "rl":
            rows[row["step"]] = {key: row[key] for key in COMPARED} | {
                "saf/kl_signal": row.get("saf/kl_signal")
            }
    return rows


def config_for(tmp_path: Path, data_files) -> Path:  # noqa: F811
    teacher = tmp_path / "teacher"
    if not teacher.is_dir():
        make_teacher(teacher, sharpen=4.0)
    settings = {"trainer.steps": 6, "trainer.save_every": 3, "sft.steps": 10, "algorithm.fusion": SAF}
    settings["trainer.log_samples_every"] = 1
    settings["teachers"] = [{"name": "t", "model_path": str(teacher)}]
    return write_config(tmp_path / "run.yaml", data_files, **settings)


def crash(config: Path, marker: str) -> None:
    """Run until the injected crash. The dead trainer's helper processes (dist_checkpointing's multiprocessing
    manager) outlive it as after a real SIGKILL, holding inherited pipes: output goes to a file, and the
    process group is reaped afterwards."""
    env = {**os.environ, "SAPO_TEST_CRASH": marker}
    log = config.parent / "crash.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(CRASHER), "train", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert returncode == 9, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_files):  # noqa: F811
    config = config_for(tmp_path_factory.mktemp("straight"), data_files)
    train(config)
    return rl_rows(config.parent / "run")


def test_resume_between_steps_is_exact(tmp_path, data_files, straight):  # noqa: F811
    config = config_for(tmp_path, data_files)
    crash(config, "step_000003:after")
    assert sorted(rl_rows(tmp_path / "run")) == [1, 2, 3]
    train(config, "--resume")
    assert rl_rows(tmp_path / "run") == straight
    assert [row["saf/coef"] for row in straight.values()][2:] != [1.0] * 4  # the anneal spans the resume
    # SAF's KL signal is the previous step's student–teacher k3 (none at step 1), across the resume too.
    signals = [row["saf/kl_signal"] for row in straight.values()]
    assert signals == [None] + [straight[step]["opd/student_teacher_k3"] for step in range(1, 6)]


def test_resume_after_a_crash_while_writing_a_checkpoint(tmp_path, data_files, straight):  # noqa: F811
    config = config_for(tmp_path, data_files)
    crash(config, "step_000006:before")
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000003"  # the interrupted save never counts
    assert not (checkpoints / "step_000006").exists()
    samples = tmp_path / "run" / "samples.jsonl"
    assert [json.loads(line)["step"] for line in samples.read_text().splitlines()][::4] == [1, 2, 3, 4, 5, 6]
    train(config, "--resume")
    # the samples of steps 4-6 written before the crash went with the resume: each step once, as in metrics
    assert [json.loads(line)["step"] for line in samples.read_text().splitlines()][::4] == [1, 2, 3, 4, 5, 6]
    assert rl_rows(tmp_path / "run") == straight
    assert (checkpoints / "latest").read_text().strip() == "step_000006"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 6
