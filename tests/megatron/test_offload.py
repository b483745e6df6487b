"""Trainer offload and onload (colocation) leave training bitwise unchanged: three steps with the trainer offloaded
after each (and its parameters brought back alone for the weight export) give the same losses, gradient norms,
exported weights and optimizer state, bit for bit, as three steps without, in one process and over gloo in TP2
and DP2 with the distributed optimizer. While offloaded no parameter holds memory."""

from __future__ import annotations

import pytest
import torch

from sapo_megatron.model.tiny import make_tiny_hf_checkpoint
from tests.distributed import run_distributed

pytestmark = pytest.mark.slow  # ranks in spawned processes

ADAM = {"name": "adam", "lr": 1e-2, "adam_eps": 1e-8}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "moe", "moe", seed=3))


def _payload(moe_dir, world, parallel, optimizer, offload, precision=None):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (3, 8, 33), generator=gen)
    mask = torch.ones_like(ids)
    mask[:, ::3, 20:] = 0
    return {
        "hf_dir": moe_dir,
        "ids": ids,
        "mask": mask,
        "world": world,
        "parallel": parallel,
        "optimizer": optimizer,
        "precision": precision or {},
        "offload": offload,
    }


def _assert_bitwise(plain, offloaded):
    assert len(plain) == len(offloaded)
    for p, o in zip(plain, offloaded):
        assert p["steps"] == o["steps"]  # floats compared exactly
        for before, after in zip(p["exported"], o["exported"]):
            assert before.keys() == after.keys()
            for name in before:
                assert torch.equal(before[name], after[name]), name
        assert len(p["optimizer_state"]) == len(o["optimizer_state"]) > 0
        for a, b in zip(p["optimizer_state"], o["optimizer_state"]):
            assert torch.equal(a, b)
        assert o["resident"] == [0, 0, 0] and o["moved"] > 0


@pytest.mark.parametrize(
    ("world", "parallel", "optimizer", "precision"),
    [
        (1, {"micro_batches": 2}, ADAM, None),
        (1, {"micro_batches": 2}, ADAM, {"dtype": "bf16"}),
        (2, {"tp": 2, "sequence_parallel": True, "micro_batches": 2}, ADAM, None),
        (2, {"micro_batches": 1}, {**ADAM, "use_distributed_optimizer": True}, None),
    ],
    ids=["single", "single-bf16", "tp2", "dp2-distopt"],
)
def test_offload_between_steps_is_bitwise_invisible(moe_dir, world, parallel, optimizer, precision):
    runs = [
        run_distributed(
            "tests.megatron.scenarios:offload_steps",
            world,
            _payload(moe_dir, world, parallel, optimizer, offload, precision),
        )
        for offload in (False, True)
    ]
    _assert_bitwise(*runs)
    first, last = runs[0][0]["exported"][0], runs[0][0]["exported"][2]
    assert any(not torch.equal(first[n], last[n]) for n in first)  # the steps update the weights
