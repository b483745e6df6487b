"""Faults inside the loop: non-finite steps are skipped, counted and stop the run after
``trainer.max_bad_steps`` in a row; the CPU server in the trainer's process takes tensor weight sync."""

from __future__ import annotations

import json
from pathlib import Path

from tests.rl.test_trainer import data_files, run_cli, train, write_config  # noqa: F401 - fixture reused

POISONER = Path(__file__).with_name("nan_loss.py")


def rows(run_dir: Path, phase: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["phase"] == phase]


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(tmp_path, data_files):  # noqa: F811
    config = write_config(
        tmp_path / "run.yaml",
        data_files,
        **{"sft.steps": 10, "sft.log_every": 1, "trainer.steps": 2, "trainer.max_bad_steps": 3},
    )
    proc = run_cli([str(POISONER)], "train", str(config), env={"SAPO_TEST_NAN_FROM": "5"}, exit_code=1)
    assert (
        "3 optimizer steps in a row had a non-finite loss or gradient norm (last at sft step 7" in proc.stderr
    )
    assert "Traceback" not in proc.stderr and "hint: lower optimizer.lr" in proc.stderr
    sft = rows(tmp_path / "run", "sft")
    assert [r["train/update_skipped"] for r in sft] == [0.0] * 4 + [1.0, 1.0]  # step 7 raised before logging
    assert sft[4]["grad_norm"] is None  # NaN: kept as null in metrics.jsonl, not dropped
    assert sft[3]["grad_norm"] is not None


def test_cpu_server_in_process_takes_tensor_weight_sync(tmp_path, data_files):  # noqa: F811
    config = write_config(
        tmp_path / "run.yaml",
        data_files,
        **{"rollout.engine": "cpu_http", "rollout.weight_sync": "tensor", "trainer.steps": 3, "sft.steps": 5},
    )
    train(config)
    rl = rows(tmp_path / "run", "rl")
    assert len(rl) == 3 and all(r["mismatch/abs_delta_mean"] < 1e-4 for r in rl)  # every sync reached it
    assert all(r["weight_sync/bytes"] > 0 for r in rl)
