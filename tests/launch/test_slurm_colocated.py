"""launch/slurm_colocated.sbatch under the real one-machine Slurm: ONE job whose node runs the CPU server standing in
for SGLang (`sapo-megatron serve`, started by the rollout script) and two trainer ranks (the train script) at once,
with ``rollout.colocation: time_shared``: the engine is released while the trainer trains, the trainer offloaded while it
generates, and the weights pushed after every step. The weights go by disk: the CPU server opens shared memory only
from a sender process it was told at start (--tensor-sender-pid), which a server started before the trainer cannot
know; SGLang's CUDA IPC path (weight_sync: tensor, the script's default) has no such check."""

from __future__ import annotations

import json
import shlex
import time

import psutil
import pytest
import yaml

from tests.launch.slurm import REPO, free_port_block, submit
from tests.launch.test_slurm import GPU_LESS, SERVER_CMD, rl_metrics, tiny_train_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]
COLOCATED_SCRIPT = REPO / "launch" / "slurm_colocated.sbatch"


def test_colocated_job_runs_servers_and_trainer_on_one_node(tmp_path, demo_model_dir, launch_env):
    output_dir = tmp_path / "run"
    config = tiny_train_config(
        tmp_path / "tiny.yaml", demo_model_dir, output_dir, steps=3, save_every=0, weight_sync="disk"
    )
    raw = yaml.safe_load(config.read_text())
    raw["rollout"]["colocation"] = {"name": "time_shared", "bucket_mb": 1}
    config.write_text(yaml.safe_dump(raw))
    env = {
        **launch_env,
        "SAPO_SERVER_CMD": f"{SERVER_CMD} --allowed-weight-dir {shlex.quote(str(tmp_path))}",
        "SAPO_SGLANG_PORT": str(free_port_block(1)),
        "SAPO_ROUTER_PORT": str(free_port_block(2)),
        "SAPO_MASTER_PORT": str(free_port_block(1)),
        "SAPO_WEIGHT_SYNC": "disk",
    }
    started = time.monotonic()
    job = submit(
        COLOCATED_SCRIPT,
        [str(config), str(demo_model_dir)],
        env=env,
        workdir=tmp_path,
        sbatch_options=[*GPU_LESS, "--nodes=1"],
    )
    assert job.wait_final(timeout=300) == "COMPLETED", job.output_text()
    print(f"colocated job: {time.monotonic() - started:.1f} s")

    log = job.output_text()
    assert "1 worker(s) healthy" in log and "1 node(s) x 2 process(es) = 2 ranks" in log, log
    records = rl_metrics(output_dir)
    assert [record["step"] for record in records] == [1, 2, 3]
    for record in records:
        # The server generated with the trainer's weights, and the trainer held no memory while it generated.
        assert record["mismatch/abs_delta_mean"] < 1e-4, record
        assert record["colocate/trainer_resident_gib_rollout"] == 0.0, record
        assert record["colocate/trainer_resident_gib_train"] > 0.0, record
    assert json.loads((output_dir / "summary.json").read_text())["steps"] == 3
    resolved = yaml.safe_load((output_dir / "config.yaml").read_text())["rollout"]
    assert (resolved["engine"], resolved["weight_sync"]) == ("sglang", "disk")
    assert resolved["colocation"] == {
        "name": "time_shared",
        "offload_trainer": True,
        "bucket_mb": 1,
        "check_weights": False,
    }
    # The job stopped its servers and removed its endpoints file (the API key stays for a requeued run).
    assert not list(tmp_path.glob("sapo-colocated-*.json"))
    assert (tmp_path / f"sapo-colocated-{job.job_id}.key").is_file()
    leftovers = [
        proc.info["pid"]
        for proc in psutil.process_iter(["pid", "cmdline"])
        if any(str(demo_model_dir) in arg for arg in proc.info["cmdline"] or [])
    ]
    assert leftovers == []


def test_colocated_job_fails_fast_when_its_servers_do_not_start(tmp_path, demo_model_dir, launch_env):
    config = tiny_train_config(
        tmp_path / "tiny.yaml", demo_model_dir, tmp_path / "run", steps=1, save_every=0
    )
    env = {**launch_env, "SAPO_SERVER_CMD": "false", "SAPO_SGLANG_PORT": str(free_port_block(1))}
    started = time.monotonic()
    job = submit(
        COLOCATED_SCRIPT,
        [str(config), str(demo_model_dir)],
        env=env,
        workdir=tmp_path,
        sbatch_options=GPU_LESS,
    )
    assert job.wait_final(timeout=60) == "FAILED"
    assert time.monotonic() - started < 30
    log = job.output_text()
    assert "exited with status 1" in log and "the rollout servers did not start" in log, log
    assert not (tmp_path / "run").exists()  # no trainer rank started
