"""``trainer.rollout_mode: fully_async`` against the real SGLang server on CPU: the producer thread generates into
the buffer while the trainer trains, two chunks in flight (``trainer.async_inflight_chunks: 2``), and every weight
update pauses the server through the client (``pause_mode: in_place``), loads the new weights from disk and
continues – the whole pipeline of loop/fully_async.py on the path an SGLang fleet takes, with R3.

What must hold: every step within ``max_staleness``; R3 replays the served routes exactly
(``routing/agreement_used`` 1.0); and the first step, whose tokens all come from version 0 (staleness 0), sees the
trainer's log-probs equal the server's within the tier's float32 tolerance – a token tagged with the wrong version
or a route from another forward would show there. The server's original weights are put back at the end.
"""

from __future__ import annotations

from tests.rl.test_trainer import data_files, metrics, train, write_config  # noqa: F401 - fixture reused
from tests.sglang_real.conftest import API_KEY, restore_weights
from tests.sglang_real.test_rl_loop import TOLERANCE


def test_fully_async_with_two_chunks_in_flight_on_real_sglang(
    tmp_path,
    data_files,  # noqa: F811 - the fixture imported above
    sglang_url,
    model_dir,
    monkeypatch,
):
    monkeypatch.setenv("SAPO_TEST_SGLANG_KEY", API_KEY)
    overrides = {
        "trainer.steps": 4,
        "trainer.prompts_per_step": 4,
        "trainer.mini_batches": 1,
        "trainer.export_hf": False,
        "eval.every": 0,
        "sft.steps": 5,
        "trainer.rollout_mode": "fully_async",
        "trainer.max_staleness": 1,
        "trainer.async_inflight_chunks": 2,
        "trainer.async_chunk_groups": 2,
        "trainer.pause_mode": "in_place",
        "rollout.engine": "sglang",
        "rollout.urls": [sglang_url],
        "rollout.weight_sync": "disk",
        "rollout.api_key_env": "SAPO_TEST_SGLANG_KEY",
        "rollout.routed_experts": True,
        "algorithm.routing_replay": "r3",
    }
    config = write_config(tmp_path / "run.yaml", data_files, **overrides)
    # an earlier test's weight label is not a version of this run
    restore_weights(sglang_url, model_dir, label="default")
    try:
        train(config)
    finally:
        restore_weights(sglang_url, model_dir, label="default")
    rl = metrics(tmp_path / "run", "rl")
    assert len(rl) == 4
    assert all(row["staleness/token_max"] <= 1.0 for row in rl), [row["staleness/token_max"] for row in rl]
    assert all(row["routing/agreement_used"] == 1.0 for row in rl)
    assert all(row["weight_sync/bytes"] > 0 for row in rl)
    fresh = [row for row in rl if row["staleness/token_max"] == 0.0]
    assert fresh and fresh[0] is rl[0]  # step 0 trains version-0 tokens only
    deltas = [row["mismatch/abs_delta_mean"] for row in fresh]
    assert all(delta < TOLERANCE for delta in deltas), deltas
    print(
        "fully_async on real SGLang: staleness/token_mean",
        [row["staleness/token_mean"] for row in rl],
        "partial samples",
        [row["async/partial_samples_frac"] for row in rl],
        "mismatch of all-fresh steps",
        deltas,
    )
