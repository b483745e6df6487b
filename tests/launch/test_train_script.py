"""Slurm mechanics of launch/slurm_train.sbatch with a stub trainer (tests/launch/stub_trainer.py): what each rank
is started with, that Slurm's signals reach the rank processes, the requeue before the time limit, the
allocation check. Seconds per test; the real trainer under the same script is in test_slurm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.launch.slurm import TRAIN_SCRIPT, Job, free_port_block, job_field, submit

pytestmark = pytest.mark.usefixtures("slurm_cluster")
STUB = Path(__file__).with_name("stub_trainer.py")
GPU_LESS = ["--gpus-per-node=0"]


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def stub_env(tmp_path: Path, launch_env: dict[str, str], **extra: str) -> dict[str, str]:
    return {
        **launch_env,
        "SAPO_MEGATRON": str(STUB),
        "SAPO_PYTHON": str(STUB),
        "STUB_LOG": str(tmp_path / "events.jsonl"),
        "STUB_NODES": "1",
        "STUB_PROCS": "2",
        "STUB_RUN_S": "120",
        **extra,
    }


def count(log: Path, event: str, restart: str | None = None) -> int:
    return sum(
        1 for e in events(log) if e["event"] == event and (restart is None or e.get("restart") == restart)
    )


@pytest.fixture
def rollout_key(tmp_path) -> tuple[Path, str]:
    """An endpoints path whose key file exists, as a running rollout job leaves it."""
    key = "ab" * 32
    key_file = tmp_path / "endpoints.key"
    key_file.write_text(key)
    key_file.chmod(0o600)
    return tmp_path / "endpoints.json", key


def test_ranks_get_their_env_and_slurm_signals_and_the_time_limit_requeues(tmp_path, launch_env, rollout_key):
    endpoints, key = rollout_key
    port = free_port_block(1)
    env = stub_env(tmp_path, launch_env, SAPO_ROLLOUT_ENDPOINTS=str(endpoints), SAPO_MASTER_PORT=str(port))
    job = submit(
        TRAIN_SCRIPT, ["cfg.yaml", "--set", "a=1"], env=env, workdir=tmp_path, sbatch_options=GPU_LESS
    )
    log = Path(env["STUB_LOG"])
    job.wait_while_alive(lambda: count(log, "start") == 2, 60, "two ranks started")

    starts = [e for e in events(log) if e["event"] == "start"]
    assert sorted(e["env"]["RANK"] for e in starts) == ["0", "1"]
    for e in starts:
        assert e["env"] | {"RANK": None, "SLURMD_NODENAME": None} == {
            "RANK": None,
            "SLURMD_NODENAME": None,
            "GROUP_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": e["env"]["RANK"],
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "SAPO_WEIGHT_SYNC_ADDR": "127.0.0.1",  # the address of SAPO_BIND_IFNAME=lo
        }
        assert e["argv"] == [
            "train", "cfg.yaml", "--set", "a=1", "--set", f"rollout.endpoints_file={endpoints}", "--resume", "auto"
        ]  # fmt: skip
        assert e["api_key"] == key
    dry_runs = [e for e in events(log) if e["event"] == "dry-run"]
    assert dry_runs[0]["argv"][-2:] == ["--world-size", "2"]

    # What `#SBATCH --signal=B:USR1@300` does before the time limit: SIGUSR1 to the batch shell only.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job.job_id], check=True)
    job.wait_until(lambda: job.state() == "PENDING", 30, "the job requeued by its script")
    assert job_field(job.job_id, "Reason") == "BeginTime"
    usr1 = [e for e in events(log) if e["event"] == "signal"]
    assert sorted((e["rank"], e["signal"]) for e in usr1) == [("0", "SIGUSR1"), ("1", "SIGUSR1")]
    assert count(log, "checkpointed") == 2

    subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], check=True)
    job.wait_while_alive(lambda: count(log, "start", restart="1") == 2, 60, "both ranks restarted")
    # scancel: Slurm sends SIGTERM to every rank itself, once.
    job.cancel()
    assert job.wait_final(timeout=60) == "CANCELLED"
    signals = [e for e in events(log) if e["event"] == "signal"]
    assert sorted((e["rank"], e["signal"]) for e in signals[2:]) == [("0", "SIGTERM"), ("1", "SIGTERM")]
    assert count(log, "checkpointed") == 4
    output = job.output_text()
    assert "requeueing job" in output and "(restart 1)" in output  # --open-mode=append kept the first run


def test_two_nodes_get_one_rank_each_with_the_first_node_as_master(tmp_path, launch_env):
    env = stub_env(tmp_path, launch_env, STUB_NODES="2", STUB_PROCS="1", STUB_RUN_S="0")
    job = submit(
        TRAIN_SCRIPT, ["cfg.yaml"], env=env, workdir=tmp_path, sbatch_options=["--nodes=2", *GPU_LESS]
    )
    assert job.wait_final(timeout=60) == "COMPLETED", job.output_text()
    starts = sorted(
        (e for e in events(Path(env["STUB_LOG"])) if e["event"] == "start"), key=lambda e: e["rank"]
    )
    assert [(e["env"]["RANK"], e["env"]["GROUP_RANK"], e["env"]["LOCAL_RANK"]) for e in starts] == [
        ("0", "0", "0"),
        ("1", "1", "0"),
    ]
    assert [e["env"]["SLURMD_NODENAME"] for e in starts] == ["sapo1", "sapo2"]
    assert {e["env"]["WORLD_SIZE"] for e in starts} == {"2"}
    assert {e["env"]["LOCAL_WORLD_SIZE"] for e in starts} == {"1"}


def test_allocation_mismatch_stops_before_any_process(tmp_path, launch_env):
    env = stub_env(tmp_path, launch_env, STUB_NODES="2", SAPO_PROCS_PER_NODE="2")
    job: Job = submit(TRAIN_SCRIPT, ["cfg.yaml"], env=env, workdir=tmp_path, sbatch_options=GPU_LESS)
    assert job.wait_final(timeout=60) == "FAILED"
    assert "allocation 1 node(s) x 2 process(es) (SAPO_PROCS_PER_NODE) = 2 ranks" in job.output_text()
    assert "launch.nodes=2 x launch.procs_per_node=2 = 4 ranks" in job.output_text()
    assert events(Path(env["STUB_LOG"])) == []  # neither the dry run nor a rank started


def test_train_job_without_a_rollout_key_waits_then_names_the_missing_file(tmp_path, launch_env):
    env = stub_env(
        tmp_path, launch_env, SAPO_ROLLOUT_ENDPOINTS=str(tmp_path / "nowhere.json"), SAPO_KEY_WAIT_S="1"
    )
    job = submit(TRAIN_SCRIPT, ["cfg.yaml"], env=env, workdir=tmp_path, sbatch_options=GPU_LESS)
    assert job.wait_final(timeout=60) == "FAILED"
    assert f"no API key file {tmp_path / 'nowhere.key'}" in job.output_text()
    assert os.path.exists(env["STUB_LOG"]) is False
