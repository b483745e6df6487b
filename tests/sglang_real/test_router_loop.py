"""The cluster path against real SGLang: a 2-process trainer (TP2 + sequence parallel) against TWO real SGLang
servers on CPU behind the real ``sglang-router`` (PyPI wheel), R3 with the servers' routes, 3 steps.

What the design does here (sapo_megatron/rollout/sglang/topology.py): the workers are discovered from the router
(``GET /workers``) for disk sync, or named in ``rollout.urls`` for distributed sync; weight updates go to every
worker (the router answers 404 to them); and because the router drops ``return_routed_experts``, a run that needs
routes probes it at start, logs so, and sends ``/generate`` to the workers directly. So R3's routes come from the
workers, never through the router; the router still serves ``/generate`` for runs without routes.

Asserted: after each sync the served log-probs equal the trainer's, ``mismatch/abs_delta_mean`` below
``TOLERANCE`` (float32 trainer, float32 servers); ``routing/agreement_used`` 1.0 at every step; at the end BOTH
workers, and the router in front of them, score the probe exactly as the exported model does. Both servers get
their original weights back afterwards (the first is the tier's shared server).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.rl.test_trainer import SHORT_TP2, data_files, metrics, train, write_config  # noqa: F401 - fixture reused
from tests.servers import local_logprobs, router, served_logprobs
from tests.sglang_real.conftest import API_KEY, real_server_flags, restore_weights, sglang_process

TOLERANCE = 1e-5  # float32 trainer vs float32 servers (the one-server loop measured 9e-8)
PROBE = [1, 14, 15, 12, 16, 17, 13]  # a tokenized prompt + answer of the character tokenizer
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def cluster(sglang_url, model_dir, tmp_path_factory):
    """The tier's shared server, a second real server on the same checkpoint, and the real router before both."""
    root = tmp_path_factory.mktemp("sglang_cluster")
    with (
        sglang_process(model_dir, root / "second.log", *real_server_flags()) as second,
        router([sglang_url, second], root / "router.log", api_key=API_KEY) as router_url,
    ):
        yield {"workers": [sglang_url, second], "router": router_url}


@pytest.mark.parametrize("weight_sync", ["disk", "distributed"])
def test_two_rank_trainer_two_real_servers_behind_the_real_router(
    weight_sync,
    tmp_path,
    data_files,  # noqa: F811 - the fixture imported above
    cluster,
    model_dir,
    monkeypatch,
):
    monkeypatch.setenv("SAPO_TEST_SGLANG_KEY", API_KEY)
    workers = {"rollout.urls": cluster["workers"]} if weight_sync == "distributed" else {}
    overrides = {
        **SHORT_TP2,
        **workers,
        "rollout.engine": "sglang",
        "rollout.router_url": cluster["router"],
        "rollout.weight_sync": weight_sync,
        "rollout.api_key_env": "SAPO_TEST_SGLANG_KEY",
        "rollout.routed_experts": True,
        "algorithm.routing_replay": "r3",
    }
    config = write_config(tmp_path / "run.yaml", data_files, **overrides)
    run = tmp_path / "run"
    try:
        proc = train(config)
        exported = local_logprobs(run / "hf", PROBE)
        served = {
            url: served_logprobs(url, PROBE, headers=HEADERS, timeout=120)
            for url in [*cluster["workers"], cluster["router"]]
        }
    finally:
        for worker in cluster["workers"]:
            restore_weights(worker, model_dir, HEADERS)
    assert "drops return_routed_experts" in proc.stdout + proc.stderr  # routes come from the workers
    rl = metrics(run, "rl")
    assert len(rl) == 3
    deltas = [row["mismatch/abs_delta_mean"] for row in rl]
    assert all(delta < TOLERANCE for delta in deltas), deltas
    assert all(row["weight_sync/bytes"] > 0 for row in rl)
    assert all(row["routing/agreement_used"] == 1.0 for row in rl), [
        row["routing/agreement_used"] for row in rl
    ]
    assert np.abs(exported - local_logprobs(model_dir, PROBE)).max() > 1e-3  # the sync changed what is served
    for url, logprobs in served.items():
        assert np.abs(logprobs - exported).max() < TOLERANCE, url  # both workers (and via the router)
    print(f"{weight_sync}: mismatch/abs_delta_mean per step {deltas}")
