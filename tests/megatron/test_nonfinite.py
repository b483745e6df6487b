"""A non-finite loss or gradient on any rank skips the optimizer update on every rank: the weights and the LR
schedule stay exactly as they were, and the next finite step updates normally."""

from __future__ import annotations

import math

import pytest
import torch

from sapo_megatron.model.tiny import make_tiny_hf_checkpoint
from tests.distributed import run_distributed


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "moe", "moe", seed=3))


@pytest.mark.parametrize(
    ("world", "parallel", "nan_rank"),
    [(1, {"micro_batches": 2}, 0), (2, {"micro_batches": 1}, 1)],
    ids=["single", "dp2-nan-on-rank1-only"],
)
def test_nonfinite_step_is_skipped_everywhere(hf_dir, world, parallel, nan_rank):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (4, 17), generator=gen)
    payload = {
        "hf_dir": hf_dir,
        "ids": ids,
        "mask": torch.ones_like(ids),
        "world": world,
        "parallel": parallel,
        "nan_rank": nan_rank,
    }
    for result in run_distributed("tests.megatron.scenarios:nonfinite_then_finite", world, payload):
        updated, grad_norm = result["first"]
        assert not updated and math.isnan(grad_norm)
        for name, tensor in result["before"].items():
            assert torch.equal(tensor, result["after_first"][name]), f"{name} changed in a skipped step"
        assert result["second"][0] and math.isfinite(result["second"][1])
        changed = [
            n for n, t in result["after_second"].items() if not torch.equal(t, result["after_first"][n])
        ]
        assert len(changed) == len(result["before"])  # Adam moves every weight on the finite step
        assert result["scheduler_steps"] == (0, 1)
