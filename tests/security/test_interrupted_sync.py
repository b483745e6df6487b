"""The first SIGTERM during a weight sync that would hang still checkpoints the step and exits (130) in seconds."""

from __future__ import annotations

from pathlib import Path

from tests.rl.test_trainer import data_files, run_cli, write_config  # noqa: F401 - fixture reused

HANGER = Path(__file__).with_name("hang_in_weight_sync.py")


def test_sigterm_during_a_hanging_weight_sync_checkpoints_and_exits(tmp_path, data_files):  # noqa: F811
    config = write_config(tmp_path / "run.yaml", data_files, **{"sft.steps": 0, "trainer.steps": 4})
    proc = run_cli(
        [str(HANGER)], "train", str(config), env={"SAPO_TEST_HANG_AT": "2"}, exit_code=130, timeout=300
    )
    assert "weight sync: waiting for a server that never answers" in proc.stdout
    assert "interrupted at RL step 2 of 4 (SIGTERM); checkpoint written" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000002"
    exited = [line for line in proc.stdout.splitlines() if line.startswith("exited ")]
    print(exited)
    assert len(exited) == 1 and float(exited[0].split()[1]) < 20  # checkpoint included; not the sync's 1800 s
