"""The project's own Slurm scripts under a real Slurm (Debian's slurm-wlm, two emulated GPU-less nodes):
the rollout job with the CPU server standing in for SGLang behind the real sglang-router, the train job with a
two-process trainer that finds those servers, syncs weights and resumes after a requeue, and the fail-fast checks.

The server command is `sapo-megatron serve` (SGLang's flags); SAPO_TEST_SERVER_CMD runs the same tests against
another one (e.g. `python -m sglang.launch_server` on a GPU machine).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.launch.slurm import (
    ROLLOUT_SCRIPT,
    TRAIN_SCRIPT,
    Job,
    free_port_block,
    port_is_free,
    read_json_when_complete,
    submit,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]
GPU_LESS = ["--gpus-per-node=0"]  # the scripts ask for 8 GPUs per node; this partition has none
SERVER_CMD = os.environ.get(
    "SAPO_TEST_SERVER_CMD",
    f"{shlex.quote(str(Path(sys.executable).parent / 'sapo-megatron'))} serve --threads 1",
)
GENERATE = {"input_ids": [1, 5, 6, 7], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}


class Rollout:
    """A running rollout job: its endpoints (as written by the job), API key and ports."""

    def __init__(self, job: Job, endpoints_file: Path, ports: list[int]) -> None:
        self.job = job
        self.endpoints_file = endpoints_file
        self.key_file = endpoints_file.with_suffix(".key")
        self.ports = ports
        self.endpoints = job.wait_while_alive(
            lambda: read_json_when_complete(endpoints_file), 180, "the endpoints file with healthy servers"
        )

    @property
    def api_key(self) -> str:
        return self.key_file.read_text()


@pytest.fixture(scope="module")
def rollout(tmp_path_factory, demo_model_dir, launch_env):
    """Two CPU servers on one node behind sglang-router, started by launch/slurm_rollout.sbatch."""
    workdir = tmp_path_factory.mktemp("rollout")
    servers, router = free_port_block(2), free_port_block(2)
    env = {
        **launch_env,
        # the trainers' disk sync writes below the tests' base directory, not beside the served model
        "SAPO_SERVER_CMD": f"{SERVER_CMD} --allowed-weight-dir {shlex.quote(str(tmp_path_factory.getbasetemp()))}",
        "SAPO_SERVERS_PER_NODE": "2",
        "SAPO_SGLANG_PORT": str(servers),
        "SAPO_ROUTER_PORT": str(router),
        "SAPO_ROLLOUT_ENDPOINTS": str(workdir / "endpoints.json"),
    }
    started = time.monotonic()
    job = submit(ROLLOUT_SCRIPT, [str(demo_model_dir)], env=env, workdir=workdir, sbatch_options=GPU_LESS)
    try:
        handle = Rollout(job, workdir / "endpoints.json", [servers, servers + 1, router, router + 1])
        print(f"rollout job ready in {time.monotonic() - started:.1f} s")
        yield handle
    finally:
        if job.state() in ("PENDING", "RUNNING"):
            job.cancel()


def test_rollout_job_publishes_workers_and_router_behind_its_api_key(rollout):
    base, router = rollout.ports[0], rollout.ports[2]
    assert rollout.endpoints == {
        "router_url": f"http://127.0.0.1:{router}",
        "workers": [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"],
        "job_id": rollout.job.job_id,
    }
    assert oct(rollout.key_file.stat().st_mode & 0o777) == "0o600"
    assert len(rollout.api_key) == 64 and int(rollout.api_key, 16) >= 0

    auth = {"Authorization": f"Bearer {rollout.api_key}"}
    through_router = httpx.post(f"{rollout.endpoints['router_url']}/generate", json=GENERATE, headers=auth)
    assert through_router.status_code == 200, through_router.text
    assert len(through_router.json()["output_ids"]) == 3
    # The router enforces its --api-key for clients, and so does every worker (the router forwards the key).
    for url in [rollout.endpoints["router_url"], *rollout.endpoints["workers"]]:
        assert httpx.post(f"{url}/generate", json=GENERATE).status_code == 401, url
        assert httpx.get(f"{url}/health").status_code == 200, url  # health stays open, as in SGLang
    listed = httpx.get(f"{rollout.endpoints['router_url']}/workers", headers=auth).json()
    assert sorted(worker["url"] for worker in listed["workers"]) == rollout.endpoints["workers"]


def test_rollout_job_fails_fast_when_a_server_exits(tmp_path, demo_model_dir, launch_env):
    env = {
        **launch_env,
        "SAPO_SERVER_CMD": "false",  # exits at once, like a server that cannot load its model
        "SAPO_SERVERS_PER_NODE": "2",
        "SAPO_SGLANG_PORT": str(free_port_block(2)),
        "SAPO_ROUTER_PORT": str(free_port_block(2)),
        "SAPO_ROLLOUT_ENDPOINTS": str(tmp_path / "endpoints.json"),
    }
    started = time.monotonic()
    job = submit(ROLLOUT_SCRIPT, [str(demo_model_dir)], env=env, workdir=tmp_path, sbatch_options=GPU_LESS)
    assert job.wait_final(timeout=60) == "FAILED"
    assert time.monotonic() - started < 30
    assert "server 0 (http://127.0.0.1" in job.output_text() and "exited with status 1" in job.output_text()
    assert not (tmp_path / "endpoints.json").exists()


def tiny_train_config(
    path: Path,
    model_dir: Path,
    output_dir: Path,
    *,
    steps: int,
    save_every: int,
    weight_sync: str = "distributed",
) -> Path:
    """Two processes (TP2 + sequence parallel) training the tiny demo MoE against the rollout job's servers.
    ``weight_sync: disk`` writes the versions under ``output_dir``'s folder (absolute: the servers read them)."""
    config = {
        "name": "slurm-ci",
        "output_dir": str(output_dir),
        "seed": 7,
        "model": {"hf_config": str(model_dir), "init": "hf", "init_path": str(model_dir)},
        "launch": {"nodes": 1, "procs_per_node": 2, "cpu_threads": 1, "timeout_minutes": 5},
        "parallel": {"tp": 2, "sequence_parallel": True},
        "optimizer": {"lr": 1.0e-3, "weight_decay": 0.0},
        "rollout": {
            "engine": "sglang",
            "weight_sync": weight_sync,
            "n_samples": 4,
            "temperature": 1.0,
            "max_new_tokens": 4,
            "startup_timeout_s": 120,
            "timeout_s": 120,
        },
        "data": {
            "train": "synthetic:addition",
            "tokenizer": "char",
            "train_size": 64,
        },
        "algorithm": {"loss": {"name": "sapo"}, "reward": "numeric_match"},
        "eval": {"datasets": [{"name": "heldout", "path": "synthetic:addition", "size": 8}]},
        "trainer": {
            "steps": steps,
            "prompts_per_step": 4,
            "mini_batches": 1,
            "save_every": save_every,
            "export_hf": False,
        },
    }
    if weight_sync == "disk":
        config["rollout"]["weight_sync_dir"] = str(output_dir.parent / "weights")
    path.write_text(yaml.safe_dump(config))
    return path


def train_env(launch_env: dict[str, str], rollout: Rollout) -> dict[str, str]:
    return {
        **launch_env,
        "SAPO_ROLLOUT_ENDPOINTS": str(rollout.endpoints_file),
        "SAPO_MASTER_PORT": str(free_port_block(1)),
    }


def rl_metrics(output_dir: Path) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record.get("phase") == "rl"]


@pytest.mark.parametrize("weight_sync", ["distributed", "disk"])
def test_train_job_finds_the_servers_trains_and_syncs_weights(
    tmp_path, rollout, demo_model_dir, launch_env, weight_sync
):
    output_dir = tmp_path / "run"
    config = tiny_train_config(
        tmp_path / "tiny.yaml", demo_model_dir, output_dir, steps=3, save_every=2, weight_sync=weight_sync
    )
    started = time.monotonic()
    job = submit(
        TRAIN_SCRIPT,
        [str(config)],
        env=train_env(launch_env, rollout),
        workdir=tmp_path,
        sbatch_options=GPU_LESS,
    )
    assert job.wait_final(timeout=300) == "COMPLETED", job.output_text()
    print(f"train job ({weight_sync} sync): {time.monotonic() - started:.1f} s")

    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    records = rl_metrics(output_dir)
    assert [record["step"] for record in records] == [1, 2, 3]
    # The served model equals the trainer's after every sync: the rollout log-probs match the trainer's.
    for record in records:
        assert record["mismatch/abs_delta_mean"] < 1e-4, record
    assert "2 ranks" in job.output_text()


def test_requeued_train_job_resumes_from_its_checkpoint(tmp_path, rollout, demo_model_dir, launch_env):
    output_dir = tmp_path / "run"
    config = tiny_train_config(tmp_path / "tiny.yaml", demo_model_dir, output_dir, steps=6, save_every=2)
    job = submit(
        TRAIN_SCRIPT,
        [str(config)],
        env=train_env(launch_env, rollout),
        workdir=tmp_path,
        sbatch_options=GPU_LESS,
    )
    job.wait_while_alive(
        lambda: (output_dir / "checkpoints" / "latest").exists(), 240, "the first checkpoint"
    )
    requeued_at = time.monotonic()
    assert os.system(f"scontrol requeue {job.job_id}") == 0
    # Slurm holds a requeued job (BeginTime about two minutes ahead); release it once it is pending again.
    job.wait_until(lambda: job.state() == "PENDING", 60, "the requeued job pending")
    assert os.system(f"scontrol update JobId={job.job_id} StartTime=now") == 0
    job.wait_until(lambda: job.state() != "PENDING", 30, "the released job running")
    print(f"requeue -> running again: {time.monotonic() - requeued_at:.1f} s")
    assert job.wait_final(timeout=300) == "COMPLETED", job.output_text()

    log = job.output_text()  # --open-mode=append: both runs in one file
    assert "train job " + job.job_id + " (restart 1)" in log
    assert "resuming from step_" in log
    assert [record["step"] for record in rl_metrics(output_dir)] == [1, 2, 3, 4, 5, 6]
    assert json.loads((output_dir / "summary.json").read_text())["steps"] == 6


def test_train_job_refuses_an_allocation_that_does_not_match_the_config(
    tmp_path, rollout, demo_model_dir, launch_env
):
    config = tiny_train_config(
        tmp_path / "tiny.yaml", demo_model_dir, tmp_path / "run", steps=1, save_every=0
    )
    env = {**train_env(launch_env, rollout), "SAPO_PROCS_PER_NODE": "3"}
    started = time.monotonic()
    job = submit(TRAIN_SCRIPT, [str(config)], env=env, workdir=tmp_path, sbatch_options=GPU_LESS)
    assert job.wait_final(timeout=60) == "FAILED"
    assert time.monotonic() - started < 30
    log = job.output_text()
    assert "allocation 1 node(s) x 3 process(es) (SAPO_PROCS_PER_NODE) = 3 ranks" in log
    assert "launch.nodes=1 x launch.procs_per_node=2 = 2 ranks" in log
    assert not (tmp_path / "run").exists()  # no rank started


def test_scancel_stops_every_rollout_process(rollout, demo_model_dir):
    started = time.monotonic()
    rollout.job.cancel()
    assert rollout.job.wait_final(timeout=60) == "CANCELLED"
    # Stopped by the scripts' SIGTERM handling, well before Slurm's SIGKILL (KillWait=30 s).
    assert time.monotonic() - started < 25
    assert all(port_is_free(port) for port in rollout.ports), rollout.ports
    leftovers = [
        proc.info["pid"]
        for proc in psutil.process_iter(["pid", "cmdline"])
        if any(str(demo_model_dir) in arg for arg in proc.info["cmdline"] or [])
    ]
    assert leftovers == []
    assert not rollout.endpoints_file.exists()
