"""``sapo-megatron compare --slurm`` under the real one-machine Slurm: two arms of the tiny demo (no warm start)
go in as one array job; SIGINT to the compare while they run cancels the job and stops the compare (exit 130);
the same command then submits both again, they resume, and the report is written; a third time submits nothing
(both arms finished) and writes the report again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.launch.slurm import REPO, job_field

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]
ARMS = ("sapo-none-none-s0", "grpo-none-none-s0")
TINY = [
    "--losses", "sapo,grpo", "--replay", "none", "--steps", "2",
    "--set", "sft.steps=0", "--set", "data.train_size=32", "--set", "eval.datasets.0.size=8",
    "--set", "trainer.prompts_per_step=4", "--set", "rollout.n_samples=4", "--set", "trainer.mini_batches=1",
    "--set", "eval.every=0", "--set", "trainer.save_every=0", "--set", "trainer.export_hf=false",
]  # fmt: skip


COMMAND = [sys.executable, "-m", "sapo_megatron.cli", "compare", "--slurm", *TINY]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}  # the Slurm tasks inherit it (sbatch --export=ALL)


def compare(root, workdir) -> subprocess.CompletedProcess:
    command = [*COMMAND, "--output-dir", str(root)]
    return subprocess.run(command, cwd=workdir, env=ENV, capture_output=True, text=True, timeout=400)


def interrupt_while_the_arms_run(root, workdir) -> tuple[str, str]:
    """SIGINT to the compare once both tasks run their trainers; returns the task id of arm 0 and the output."""
    console = workdir / "interrupted.txt"
    with console.open("w") as out:
        proc = subprocess.Popen(
            [*COMMAND, "--output-dir", str(root)], cwd=workdir, env=ENV, stdout=out, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 120
    while not all((root / arm / "train.log").exists() for arm in ARMS):
        assert proc.poll() is None and time.monotonic() < deadline, console.read_text()
        time.sleep(0.1)
    task = (root / ARMS[0] / "slurm-job").read_text().strip()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=150) == 130, console.read_text()
    return task, console.read_text()


def test_compare_slurm_runs_the_arms_as_one_array_job_and_resumes(tmp_path):
    root = tmp_path / "cmp"
    cancelled, console = interrupt_while_the_arms_run(root, tmp_path)
    assert f"cancelling Slurm job {cancelled.partition('_')[0]}" in console, console
    assert "run the same command again" in console
    assert job_field(cancelled, "JobState") == "CANCELLED"
    assert not (root / "report.json").exists()

    first = compare(root, tmp_path)
    print(first.stdout)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (
        "arms: Slurm array job" in first.stdout
        and "2 task(s): sapo-none-none-s0, grpo-none-none-s0" in first.stdout
    )
    tasks = [(root / arm / "slurm-job").read_text().strip() for arm in ARMS]
    job = tasks[0].partition("_")[0]
    assert job != cancelled.partition("_")[0]
    assert tasks == [f"{job}_0", f"{job}_1"]
    assert job_field(f"{job}_0", "JobName") == "sapo-compare"
    assert job_field(f"{job}_1", "JobState") == "COMPLETED"
    for arm in ARMS:
        assert f"{arm} ({job}_" in first.stdout
        rows = [json.loads(line) for line in (root / arm / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows if row["phase"] == "rl"] == [1, 2]
    report = json.loads((root / "report.json").read_text())
    assert sorted(arm["name"] for arm in report["arms"]) == sorted(ARMS)
    assert all(arm["steps"] == 2 for arm in report["arms"])
    assert "failed" not in first.stdout
    assert (root / "report.md").is_file()

    report_mtime = (root / "report.json").stat().st_mtime_ns
    second = compare(root, tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "array job" not in second.stdout
    assert all(f"{arm} finished earlier: reward" in second.stdout for arm in ARMS), second.stdout
    assert (root / "report.json").stat().st_mtime_ns > report_mtime
