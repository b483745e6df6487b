"""The RL loop against the real SGLang server on CPU: ``rollout.engine: sglang``, disk or distributed weight sync
(``init_weights_update_group`` over gloo + ``update_weights_from_distributed``), R3 with the server's routes, 3 steps
of a 1-process trainer on the tier's shared server (conftest.py).

After each sync the served log-probs must equal the trainer's: ``mismatch/abs_delta_mean`` (mean |rollout - trainer|
over the response tokens) below ``TOLERANCE`` (both float32 here), and R3 replays the served routes exactly
(``routing/agreement_used`` 1.0). The server's original weights are put back at the end.
"""

from __future__ import annotations

import pytest

from tests.rl.test_trainer import data_files, metrics, train, write_config  # noqa: F401 - fixture reused
from tests.sglang_real.conftest import API_KEY, restore_weights

TOLERANCE = 1e-5  # float32 trainer vs float32 server; measured 9e-8 (docs/cluster.md)


@pytest.mark.parametrize("weight_sync", ["disk", "distributed"])
def test_rl_steps_against_real_sglang_with_r3(
    weight_sync,
    tmp_path,
    data_files,  # noqa: F811 - the fixture imported above
    sglang_url,
    model_dir,
    monkeypatch,
):
    monkeypatch.setenv("SAPO_TEST_SGLANG_KEY", API_KEY)
    overrides = {
        "trainer.steps": 3,
        "sft.steps": 5,
        "rollout.engine": "sglang",
        "rollout.urls": [sglang_url],
        "rollout.weight_sync": weight_sync,
        "rollout.api_key_env": "SAPO_TEST_SGLANG_KEY",
        "rollout.routed_experts": True,
        "algorithm.routing_replay": "r3",
    }
    config = write_config(tmp_path / "run.yaml", data_files, **overrides)
    try:
        train(config)
    finally:
        restore_weights(sglang_url, model_dir)
    rl = metrics(tmp_path / "run", "rl")
    assert len(rl) == 3
    deltas = [row["mismatch/abs_delta_mean"] for row in rl]
    assert all(delta < TOLERANCE for delta in deltas), deltas
    assert all(row["weight_sync/bytes"] > 0 for row in rl)
    assert all(row["routing/agreement_used"] == 1.0 for row in rl), [
        row["routing/agreement_used"] for row in rl
    ]
    print("mismatch/abs_delta_mean per step:", deltas)
