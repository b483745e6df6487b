"""Routing replay in the RL loop, with a real source of mismatch (the fp8 rollout engine): R3 trains on exactly
the engine's routes, R2 on the trainer's own recorded routes; the routing metrics say so at every step, and a
resumed R3 run repeats an uninterrupted one bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.rl.test_resume import crash
from tests.rl.test_trainer import data_files, train, write_config  # noqa: F401 - fixture reused

ROUTED = {"rollout.routed_experts": True, "rollout.precision": "fp8", "trainer.steps": 4, "sft.steps": 20}
COMPARED = (
    "reward/mean",
    "loss/total",
    "grad_norm",
    "mismatch/k3",
    "routing/agreement",
    "routing/agreement_used",
)


def rl_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["phase"] == "rl"]


@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_routing_metrics_follow_the_replay_mode(tmp_path, data_files, replay):  # noqa: F811
    config = write_config(tmp_path / "run.yaml", data_files, **ROUTED, **{"algorithm.routing_replay": replay})
    train(config)
    rows = rl_rows(tmp_path / "run")
    assert len(rows) == 4
    for row in rows:
        assert 0.5 < row["routing/agreement"] < 1.0  # the fp8 engine routes some token-layers differently
        assert row["mismatch/k3"] > 0 and row["time/replay_s"] >= 0
        assert {"routing/agreement_layer0", "routing/agreement_layer1"} <= set(row)
        if replay == "r3":
            assert (
                row["routing/agreement_used"] == 1.0
            )  # trained on the engine's routes, every token and layer
        elif replay == "r2":  # trained on the routes recorded in the old-log-prob pass
            assert row["routing/agreement_used"] == pytest.approx(row["routing/agreement"], abs=1e-12)


def test_resume_with_r3_is_exact(tmp_path, data_files):  # noqa: F811
    overrides = {**ROUTED, "algorithm.routing_replay": "r3", "trainer.steps": 6, "trainer.save_every": 3}
    for name in ("straight", "resumed"):
        (tmp_path / name).mkdir()
    straight = write_config(tmp_path / "straight" / "run.yaml", data_files, **overrides)
    train(straight)
    resumed = write_config(tmp_path / "resumed" / "run.yaml", data_files, **overrides)
    crash(resumed, "step_000003:after")
    train(resumed, "--resume")
    expected = {r["step"]: {k: r[k] for k in COMPARED} for r in rl_rows(straight.parent / "run")}
    assert {r["step"]: {k: r[k] for k in COMPARED} for r in rl_rows(resumed.parent / "run")} == expected
