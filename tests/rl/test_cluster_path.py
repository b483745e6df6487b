"""The path users take on a cluster, on CPU: a 2-process trainer (TP2 + sequence parallel) against two CPU servers
in their own processes behind the REAL sglang-router, with each weight-sync mode that reaches remote servers.

After every sync the served log-probs must equal the trainer's (``mismatch/abs_delta_mean`` at every step), and
at the end every worker serves exactly the exported model."""

from __future__ import annotations

import numpy as np
import pytest

from tests.rl.test_trainer import SHORT_TP2, data_files, metrics, train, write_config  # noqa: F401 - fixture reused
from tests.servers import cpu_server, local_logprobs, router, save_demo_model, served_logprobs

PROBE = [1, 14, 15, 12, 16, 17, 13]  # a tokenized prompt + answer of the character tokenizer


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    model = save_demo_model(
        root / "served", seed=7
    )  # not the trainer's weights: the first sync replaces them
    runs = tmp_path_factory.getbasetemp()  # the tests' run directories (their weight_sync_dir) lie below it
    with (
        cpu_server(model, root / "w1.log", allowed_weight_dir=runs) as w1,
        cpu_server(model, root / "w2.log", allowed_weight_dir=runs) as w2,
        router([w1, w2], root / "router.log") as r,
    ):
        yield {"workers": [w1, w2], "router": r, "model": model}


@pytest.mark.parametrize(
    ("weight_sync", "rollout_keys"),
    [
        ("disk", lambda s: {"router_url": s["router"]}),  # workers discovered from the router
        ("distributed", lambda s: {"router_url": s["router"], "urls": s["workers"]}),
    ],
    ids=["disk", "distributed"],
)
def test_two_rank_trainer_behind_the_real_router(tmp_path, data_files, servers, weight_sync, rollout_keys):  # noqa: F811
    rollout = {**rollout_keys(servers), "engine": "sglang", "weight_sync": weight_sync}
    config = write_config(
        tmp_path / "run.yaml",
        data_files,
        **SHORT_TP2,
        **{f"rollout.{key}": value for key, value in rollout.items()},
    )
    train(config)
    run = tmp_path / "run"
    rl = metrics(run, "rl")
    assert len(rl) == 3
    assert all(row["mismatch/abs_delta_mean"] < 1e-4 for row in rl), [
        r["mismatch/abs_delta_mean"] for r in rl
    ]
    assert all(row["weight_sync/bytes"] > 0 for row in rl)
    exported = local_logprobs(run / "hf", PROBE)
    assert (
        np.abs(exported - local_logprobs(servers["model"], PROBE)).max() > 1e-3
    )  # the sync changed what is served
    for worker in servers["workers"]:
        assert np.abs(served_logprobs(worker, PROBE) - exported).max() < 1e-5, worker
