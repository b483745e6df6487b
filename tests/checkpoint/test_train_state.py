"""Training state (model + distributed optimizer + schedule + RNG) survives a save/load exactly, and a save that
crashes half-way leaves the previous checkpoint as the one that loads (2 processes, EP2, distributed Adam)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed


@pytest.fixture(scope="module")
def outcome(hf_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("train_state")
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 64, (4, 17), generator=gen) for _ in range(2)]
    payload = {
        "hf_dir": str(hf_checkpoints["moe-fp32"]),
        "root": str(root / "checkpoints"),
        "parallel": {"ep": 2},
        "batches": batches,
    }
    return run_distributed("tests.checkpoint.scenarios:train_state", 2, payload)


def test_restored_engine_takes_the_identical_next_step(outcome):
    for rank in outcome:
        assert rank["step2_restored"] == rank["step2"]
        assert rank["weights2_restored"].keys() == rank["weights2"].keys()
        for name, tensor in rank["weights2"].items():
            assert torch.equal(rank["weights2_restored"][name], tensor), name
        differs = any(not torch.equal(rank["weights_fresh"][n], t) for n, t in rank["weights2"].items())
        assert differs, "the fresh engine started from the same weights: the test proves nothing"


def test_extra_and_rng_restored(outcome):
    for rank in outcome:
        assert rank["extra"] == {"step": 1, "data_position": 8}
        assert rank["rng_same"]


def test_crashed_save_leaves_previous_checkpoint(outcome):
    for rank in outcome:
        assert rank["crashed"] == "simulated crash after the shards were written"
        assert rank["latest_after_crash"] == "step_1"
        assert "is not a complete checkpoint" in rank["partial_error"]
        assert ".step_2.partial" in rank["partial_error"]


def test_keep_prunes_older_states(outcome):
    dirs = outcome[0]["dirs_at_end"]
    assert "step_3" in dirs and "latest" in dirs
    assert "step_1" not in dirs, "keep=1 should have removed the older state"
