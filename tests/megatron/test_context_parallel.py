"""Context parallelism (``parallel.cp: 2``) gives the single-process numbers, in fp32 on tiny Qwen3-MoE over gloo:
full-vocabulary logits, per-sequence log-probs and entropies, the queries after RoPE (global positions), live MoE
routes and the routing-agreement metric over whole sequences, and one RL update's loss, gradient norm, every
metric and the gradients (SGD lr 1: the updated weights) – for SAPO replaying the engine's routes (R3, entropy and
KL terms, TIS), GSPO (sequence-level ratios, live routing), token-mean GRPO and SFT, with padded and packed
micro-batches, in CP2, CP2 × EP2, CP2 × TP2 with SP and CP2 × PP2. R3 replays exactly the engine's routes into
each CP rank's chunks (an independent hook on every router).

Tolerances as the other layout tests (logits 1e-5 absolute; loss, gradient norm and metrics 1e-5 relative;
gradients 1e-5 of the largest); measured at cp 2 against cp 1: logits ≤ 1.2e-7, log-probs ≤ 4.8e-7, gradients
≤ 1.7e-8 absolute. Three spawns (1, 2 and 4 processes).
"""

from __future__ import annotations

import pytest
import torch

from sapo_megatron.megatron.context_parallel import segment_chunk_indices, token_shards
from sapo_megatron.model.tiny import make_tiny_hf_checkpoint
from tests.distributed import run_distributed

BUDGET = 48
SEQUENCES = 8
MICRO_BATCHES = 2
LOGITS_ATOL = 1e-5
LOGP_ATOL = 1e-5
RTOL = 1e-5
METRIC_ATOL = 1e-6

LAYOUTS = {
    "single": (1, {}),
    "cp2": (2, {"cp": 2}),
    "cp2-ep2": (2, {"cp": 2, "ep": 2}),
    "cp2-tp2-sp": (4, {"cp": 2, "tp": 2, "sequence_parallel": True}),
    "cp2-pp2": (4, {"cp": 2, "pp": 2}),
}
ALL_UPDATES = ["sapo_r3", "gspo_live", "grpo_token_mean"]
GRADS = {
    "cp2": True,
    "cp2-ep2": False,
}  # gradients compared: all, or all but the experts (split over EP ranks)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "moe", "moe", seed=3))


@pytest.fixture(scope="module")
def runs(hf_dir):
    """Layout name → per-rank results, spawned per world size on first use."""
    cache: dict[str, list[dict]] = {}
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))

    def get(name: str) -> list[dict]:
        if name not in cache:
            world = LAYOUTS[name][0]
            names = [n for n, (w, _) in LAYOUTS.items() if w == world]
            cases = [
                {
                    "parallel": {**LAYOUTS[n][1], "micro_batches": MICRO_BATCHES},
                    "updates": ALL_UPDATES if world < 4 else ["sapo_r3", "gspo_live"],
                    "sft": world < 4,
                }
                for n in names
            ]
            payload = {
                "hf_dir": hf_dir,
                "world": world,
                "sequences": SEQUENCES,
                "budget": BUDGET,
                "ids": ids,
                "cases": cases,
            }
            results = run_distributed("tests.megatron.cp_scenarios:cp_cases", world, payload, timeout=900)
            for index, n in enumerate(names):
                cache[n] = [rank[index] for rank in results]
        return cache[name]

    return get


def test_chunks_are_megatrons_load_balanced_split():
    """Rank i holds chunks i and 2·cp−1−i of every segment (``get_batch_on_this_cp_rank`` on a padded row, TE's
    ``thd_get_partitioned_indices`` per packed slot); together the ranks hold each position once."""
    assert segment_chunk_indices([0, 8], 2, 0).tolist() == [0, 1, 6, 7]
    assert segment_chunk_indices([0, 8], 2, 1).tolist() == [2, 3, 4, 5]
    assert segment_chunk_indices([0, 4, 12], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    packed = {
        "input_ids": torch.zeros(1, 12, dtype=torch.long),
        "segment_ids": torch.tensor([[0] * 4 + [1] * 8]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]),
    }
    shards = token_shards(packed, 2, 0)
    assert shards.local.tolist() == [0, 3, 4, 5, 10, 11]
    assert sorted(shards.gathered.tolist()) == list(range(12))
    with pytest.raises(ValueError, match="not a multiple of 2·cp = 4"):
        segment_chunk_indices([0, 6], 2, 0)


class _FakeGroup:
    """What Megatron's THD RoPE reads of a CP group: its size and this rank."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("cp", [2, 4])
def test_chunks_match_megatrons_thd_rope_partition(cp):
    """The GPU path (TE spec, packed THD): Megatron's ``_apply_rotary_pos_emb_thd`` gives a CP rank's tokens the
    angles of chunks ``r`` and ``2·cp−1−r`` of each sequence (``cu_seqlens`` of whole slots); on this rank's
    tokens as :func:`token_shards` picks them, that is RoPE at each token's position in its sequence – what the
    CPU path computes (``rope_at_global_positions``)."""
    from megatron.core.models.common.embeddings.rope_utils import (
        _apply_rotary_pos_emb_bshd,
        _apply_rotary_pos_emb_thd,
    )
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from sapo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # Megatron's rotary asks torch.cuda for its device
    lengths = [4 * cp, 2 * cp, 6 * cp]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    batch = {
        "input_ids": torch.zeros_like(positions),
        "segment_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None],
        "position_ids": positions,
    }
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    freqs = rope.get_emb(max(lengths))
    gen = torch.Generator().manual_seed(0)
    for rank in range(cp):
        local = token_shards(batch, cp, rank).local
        t = torch.randn(len(local), 2, 8, generator=gen)
        megatron = _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=_FakeGroup(cp, rank))
        ours = _apply_rotary_pos_emb_bshd(t[:, None], freqs[positions[0, local]])[:, 0]
        torch.testing.assert_close(megatron, ours, atol=0, rtol=0)


def _merged(ranks: list[dict], run: str, key: str) -> dict[int, torch.Tensor]:
    merged: dict[int, torch.Tensor] = {}
    for rank in ranks:
        for index, value in rank[run].get(key, {}).items():
            if index in merged:  # CP and TP ranks hold the same whole sequences
                torch.testing.assert_close(value, merged[index], atol=LOGP_ATOL, rtol=0)
            merged[index] = value
    return merged


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n != "single"])
def test_logits_equal_cp1(runs, layout):
    want = runs("single")[0]["logits"]
    got = [r["logits"] for r in runs(layout) if r["logits"] is not None]
    assert got  # the last pipeline stage's ranks
    for logits in got:
        assert logits.shape == want.shape
        assert float((logits - want).abs().max()) <= LOGITS_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("run", ["padded", "packed"])
@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n != "single"])
def test_rl_step_equals_cp1(runs, layout, run):
    single, ranks = runs("single")[0], runs(layout)
    for key in ("logp", "entropy"):
        got = _merged(ranks, run, key)
        assert sorted(got) == list(range(SEQUENCES))
        assert _max_diff(_merged([single], "padded", key), got) <= LOGP_ATOL, key
    want_updates = single["padded"]["updates"]
    for rank in ranks:
        assert set(rank[run]["updates"]) <= set(want_updates)
        for name, update in rank[run]["updates"].items():
            _assert_same_update(want_updates[name], update, name, experts=GRADS.get(layout))


def _assert_same_update(want: dict, got: dict, name: str, *, experts: bool | None) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=RTOL), name
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL), name
    assert want["grad_norm"] > 1e-2
    assert set(got.get("metrics", {})) == set(want.get("metrics", {}))
    for metric, value in want.get("metrics", {}).items():
        assert got["metrics"][metric] == pytest.approx(value, rel=RTOL, abs=METRIC_ATOL), metric
    if experts is None:  # parameters split over TP / PP ranks: the gradient norm above covers them
        return
    # SGD at lr 1: the updated weights differ from the start by the gradients
    names = [n for n in want["grads"] if experts or "experts" not in n]
    scale = max(float(want["grads"][n].abs().max()) for n in names)
    worst = max(float((want["grads"][n] - got["grads"][n]).abs().max()) for n in names)
    assert worst <= RTOL * scale, f"{name}: gradients differ by {worst:.3g} (largest {scale:.3g})"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp2", "cp2-ep2"])
def test_rope_uses_global_positions(runs, layout):
    """The first attention's queries after RoPE, gathered back per sequence, are the single process's: each CP
    rank's chunks carry their tokens' positions in the sequence (packed: in their slot)."""
    single = runs("single")[0]["padded"]["queries"]
    for rank in runs(layout):
        for run in ("padded", "packed"):
            assert _max_diff(single, rank[run]["queries"]) <= LOGP_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n != "single"])
def test_routes_and_r3_under_cp(runs, layout):
    """Live routes recorded in the old-log-prob pass give the single process's agreement with the engine's routes
    (measured over whole sequences); R3 replays the engine's routes into every CP rank's chunks exactly."""
    want, _ = runs("single")[0]["padded"]["agreement"]
    for rank in runs(layout):
        for run in ("padded", "packed"):
            overall, _ = rank[run]["agreement"]
            assert overall == pytest.approx(want, abs=1e-12)
            step = rank[run]["updates"]["sapo_r3"]
            assert step["router_calls"]["worst_row_agreement"] == 1.0
            assert step["used"] == 1.0
