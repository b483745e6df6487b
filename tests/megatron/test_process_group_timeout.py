"""launch.timeout_minutes reaches the process groups (the main rank may roll out for longer than torch's default
30 minutes while the other ranks wait in a collective)."""

from __future__ import annotations

from sapo_megatron.config import config_from_dict
from sapo_megatron.model.tiny import make_tiny_hf_checkpoint, tiny_hf_config
from tests.distributed import run_distributed


def test_default_timeout_covers_long_rollouts():
    assert config_from_dict({"model": {"hf_config": tiny_hf_config("moe")}}).launch.timeout_minutes == 60


def test_timeout_reaches_the_default_and_megatron_groups(tmp_path):
    hf_dir = str(make_tiny_hf_checkpoint(tmp_path / "moe", "moe"))
    payload = {"hf_dir": hf_dir, "world": 2, "parallel": {}, "timeout_minutes": 95}
    for timeouts in run_distributed("tests.megatron.scenarios:process_group_timeouts", 2, payload):
        assert timeouts == [95 * 60.0, 95 * 60.0]
