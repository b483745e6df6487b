"""Distributed weight sync between real processes: a CPU server process and a trainer process (gloo).

One server process (``python -m sapo_megatron.rollout.cpu.server`` with a 4 s ``--dist-timeout``) serves every
step; the trainer process (:mod:`tests.rollout.weight_trainer`) reports what it saw as JSON.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch

from sapo_megatron.rollout.tensor_transport import serialize_named_tensors
from tests.ports import free_port
from tests.rollout.conftest import load, reference_logprobs
from tests.rollout.server_process import REPO_ROOT, ServerProcess, child_env

DIST_TIMEOUT_S = 4.0
CONNECT_TIMEOUT_S = 1.0
LOGP_ATOL = 1e-4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(moe_dir):
    proc = ServerProcess(
        "--model-path",
        str(moe_dir),
        "--port",
        "0",
        "--threads",
        "1",
        "--dist-timeout",
        str(DIST_TIMEOUT_S),
        "--weight-group-connect-timeout",
        str(CONNECT_TIMEOUT_S),
    )
    yield proc
    proc.stop()


def run_trainer(server_url: str, weights: str) -> dict:
    cfg = {
        "url": server_url,
        "weights": weights,
        "port_a": free_port(),
        "port_b": free_port(),
        "timeout_s": DIST_TIMEOUT_S,
    }
    script = str(REPO_ROOT / "tests" / "rollout" / "weight_trainer.py")
    done = subprocess.run(
        [sys.executable, script, json.dumps(cfg)],
        capture_output=True,
        text=True,
        # as under torchrun: the weight-update group must still host its own store on the trainer (rank 0)
        env={**child_env(), "TORCHELASTIC_USE_AGENT_STORE": "True"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def served_logprobs(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
        "return_logprob": True,
    }
    meta = httpx.post(url + "/generate", json=body, timeout=60).json()
    ids = [entry[1] for entry in meta["meta_info"]["output_token_logprobs"]]
    return ids, [entry[0] for entry in meta["meta_info"]["output_token_logprobs"]]


def test_trainer_process_broadcasts_new_weights_to_a_server_process(server, moe_dir_b):
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert info["weight_version"] == "0" and info["tp_size"] == 1

    report = run_trainer(server.url, str(moe_dir_b / "model.safetensors"))

    # Bad metadata is refused at once (well inside the 4 s group timeout), before any broadcast.
    by_case = {r["case"]: r for r in report["refused"]}
    for case, words in {
        "unknown_name": "unknown weight name",
        "wrong_shape": "shape",
        "bad_dtype": "float33",
    }.items():
        refused = by_case[case]
        assert refused["status"] == 400 and refused["success"] is False, refused
        assert words in refused["message"] and refused["elapsed_s"] < 2.0, refused
    update = report["update"]
    assert update["success"] is True and update["message"] == "Succeeded to update parameter online."
    assert update["num_tensors"] > 50  # every per-expert weight, by its checkpoint name
    # Refused while the trainer was already broadcasting: it stops on the reply, not after the group timeout.
    late = report["refused_while_broadcasting"]
    assert late["raised"] is True and "shape" in late["message"] and late["elapsed_s"] < 2.0, late
    assert report["destroy"]["message"] == "Succeeded to destroy custom process group."
    assert report["default_group_intact"] is True

    # Served log-probs are those of the broadcast weights (moe_dir_b), and the version advanced once.
    reference_b = load(moe_dir_b)
    for prompt in ([1, 2, 3, 4], [9, 8, 7]):
        ids, logps = served_logprobs(server.url, prompt)
        np.testing.assert_allclose(
            logps, reference_logprobs(reference_b, prompt + ids, len(prompt)), atol=LOGP_ATOL
        )
    assert httpx.get(server.url + "/get_weight_version", timeout=30).json() == {"weight_version": "1"}

    # world_size 3 with two processes: both sides give up after their timeout, with a message that says why.
    wrong = report["wrong_world_size"]
    assert "did not form" in wrong["trainer_error"] and wrong["trainer_elapsed_s"] < DIST_TIMEOUT_S + 5
    assert "did not form" in wrong["server_error"] and wrong["server_elapsed_s"] < DIST_TIMEOUT_S + 8


def test_unreachable_master_is_refused_after_the_connect_timeout(server):
    body = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),  # nobody listens there
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "nobody_home",
        "backend": "gloo",
    }
    started = time.monotonic()
    reply = httpx.post(server.url + "/init_weights_update_group", json=body, timeout=60)
    elapsed = time.monotonic() - started
    assert reply.status_code == 400 and reply.json()["success"] is False
    message = reply.json()["message"]
    assert (
        message.startswith("Failed to initialize custom process group:")
        and "no weight-update group store" in message
    )
    assert CONNECT_TIMEOUT_S - 0.2 < elapsed < CONNECT_TIMEOUT_S + 3  # not --dist-timeout


def test_server_process_exits_cleanly_on_sigterm(moe_dir):
    proc = ServerProcess("--model-path", str(moe_dir), "--port", "0", "--threads", "1")
    assert httpx.get(proc.url + "/health", timeout=30).status_code == 200
    assert proc.stop(signal.SIGTERM) == 0
    assert len(proc.lines) == 1 and "Traceback" not in proc.stderr


def test_tensor_payload_from_another_process_is_refused_with_the_way_out(server):
    # torch's default sharing strategy lends file descriptors that only this process's children may open.
    body = {"serialized_named_tensors": [serialize_named_tensors([("model.norm.weight", torch.ones(32))])]}
    reply = httpx.post(server.url + "/update_weights_from_tensor", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["success"] is False
    assert "set_sharing_strategy('file_system')" in reply.json()["message"]
