"""One training step of tiny Qwen3-MoE / Qwen3 gives the same loss, gradient norm and updated weights in every
parallel layout as in a single process (2 and 4 processes over gloo), context parallelism (CP2, CP2 × DP2)
included."""

from __future__ import annotations

import pytest
import torch

from sapo_megatron.model.tiny import make_tiny_hf_checkpoint
from sapo_megatron.plan import stage_shards
from tests.distributed import run_distributed
from tests.megatron.scenarios import layout_config

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: str(make_tiny_hf_checkpoint(root / kind, kind, seed=3)) for kind in ("moe", "dense")}


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 64, (8, 33), generator=gen)
    mask = torch.ones_like(ids)
    mask[::3, 20:] = 0  # padded rows: the global token normaliser must hold across ranks
    return ids, mask


def _run(hf_dir, batch, world, parallel, **extra):
    payload = {
        "hf_dir": hf_dir,
        "ids": batch[0],
        "mask": batch[1],
        "world": world,
        "parallel": parallel,
        **extra,
    }
    results = run_distributed("tests.megatron.scenarios:sft_step", world, payload)
    weights = {}
    for r in results:
        assert not set(weights) & set(r["weights"]), "a tensor was exported by two ranks"
        weights.update(r["weights"])
    return results[0], weights


@pytest.fixture(scope="module")
def reference(checkpoints, batch):
    return {kind: _run(checkpoints[kind], batch, 1, {"micro_batches": 2}) for kind in checkpoints}


def _check_plan_counts(payload, results):
    """The dry-run plan's per-rank parameter counts equal what Megatron built on each rank."""
    cfg = layout_config(payload)
    expected = {shard.pp_rank: shard.params for shard in stage_shards(cfg)}
    for result in results:
        assert result["local_params"] == expected[result["pp_rank"]]


def _assert_same(ref, got):
    ref_step, ref_w = ref
    step, weights = got
    assert step["loss"] == pytest.approx(ref_step["loss"], rel=LOSS_RTOL)
    assert step["grad_norm"] == pytest.approx(ref_step["grad_norm"], rel=LOSS_RTOL)
    assert set(weights) == set(ref_w)
    worst = max((weights[n] - ref_w[n]).abs().max().item() for n in ref_w)
    assert worst <= WEIGHT_ATOL, f"updated weights differ by {worst:.3g}"


def test_reference_step_learns(reference):
    step, _ = reference["moe"]
    assert 3.5 < step["loss"] < 4.7  # ~ln(64) for a random model
    assert step["grad_norm"] > 0


@pytest.mark.parametrize(
    ("kind", "world", "parallel"),
    [
        ("moe", 2, {"tp": 2, "sequence_parallel": True, "micro_batches": 2}),
        ("moe", 2, {"ep": 2, "micro_batches": 2}),
        ("moe", 2, {"pp": 2, "micro_batches": 2}),
        ("moe", 2, {"micro_batches": 1}),  # pure data parallel, 1 micro-batch of 4 rows per rank
        ("dense", 2, {"tp": 2, "micro_batches": 2}),
        ("moe", 4, {"tp": 2, "ep": 2, "sequence_parallel": True, "micro_batches": 2}),
        ("moe", 2, {"cp": 2, "micro_batches": 2}),  # context parallelism: each sequence over both ranks
        ("dense", 2, {"cp": 2, "micro_batches": 2}),
        ("moe", 4, {"cp": 2, "micro_batches": 2}),  # CP2 × DP2
    ],
    ids=[
        "moe-tp2-sp",
        "moe-ep2",
        "moe-pp2",
        "moe-dp2",
        "dense-tp2",
        "moe-tp2xep2",
        "moe-cp2",
        "dense-cp2",
        "moe-cp2xdp2",
    ],
)
def test_layout_matches_single_process(checkpoints, batch, reference, kind, world, parallel):
    _assert_same(reference[kind], _run(checkpoints[kind], batch, world, parallel))


def test_distributed_optimizer_matches_single_process(checkpoints, batch, reference):
    """Megatron's distributed optimizer: optimizer state sharded over the two data-parallel ranks."""
    # Megatron shards Adam only; eps = 1 makes its first step ~lr·g (well-conditioned), like the SGD reference.
    adam = {"name": "adam", "adam_eps": 1.0}
    single = _run(checkpoints["moe"], batch, 1, {"micro_batches": 2}, optimizer=adam)
    sharded = _run(
        checkpoints["moe"],
        batch,
        2,
        {"micro_batches": 1},
        optimizer={**adam, "use_distributed_optimizer": True},
    )
    _assert_same(single, sharded)


def test_micro_batch_split_does_not_change_step(checkpoints, batch, reference):
    _assert_same(reference["moe"], _run(checkpoints["moe"], batch, 1, {"micro_batches": 4}))
