"""Packed micro-batches (``parallel.max_tokens_per_micro_batch``) give the same RL update as right-padded ones in
every parallel layout: log-probs and entropies per sequence, the queries each attention sees after RoPE (RoPE
restarts per sequence), live MoE routes per token, the routing-agreement metric, the loss, every reported metric
and every gradient; R3 replays the engine's routes into the packed rows (an independent hook on each router sees
exactly those experts, forward and per micro-batch); every rank and pipeline stage runs the same number of
micro-batches of one shape.

Tolerances (fp32, tiny Qwen3-MoE, 8 sequences of 4-26 tokens packed into 48-token rows): log-probs and entropies
2e-6 absolute, loss and gradient norm 1e-6 relative, metrics 1e-5 relative (1e-6 absolute), each gradient
element 1e-7 absolute (the differences are summation order: attention rows of a different length, a different
token order in the matmuls; measured: log-probs ≤ 4.8e-7, loss and gradient norm ≤ 2.2e-7 relative, gradients
≤ 1.5e-8).

Three spawns (1, 2 and 4 processes); the 2-process one runs TP2+SP, EP2, PP2 and DP2 in turn.
"""

from __future__ import annotations

import pytest
import torch

from sapo_megatron.model.tiny import make_tiny_hf_checkpoint
from tests.distributed import run_distributed

BUDGET = 48
SEQUENCES = 8
MICRO_BATCHES = 2
LOGP_ATOL = 2e-6
LOSS_RTOL = 1e-6
METRIC_RTOL, METRIC_ATOL = 1e-5, 1e-6
GRAD_ATOL = 1e-7
CROSS_LAYOUT_RTOL, CROSS_LAYOUT_LOGP_ATOL = 1e-5, 1e-5  # a layout against the single process (as elsewhere)

LAYOUTS = {
    "single": (1, {}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "ep2": (2, {"ep": 2}),
    "pp2": (2, {"pp": 2}),
    "dp2": (2, {}),
    "tp2xep2": (4, {"tp": 2, "ep": 2, "sequence_parallel": True}),
}
SINGLE_UPDATES = ["sapo_r3", "gspo_live", "grpo_token_mean"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "moe", "moe", seed=3))


@pytest.fixture(scope="module")
def runs(hf_dir):
    """Layout name → per-rank results, spawned per world size on first use."""
    cache: dict[str, list[dict]] = {}

    def get(name: str) -> list[dict]:
        if name not in cache:
            world = LAYOUTS[name][0]
            names = [n for n, (w, _) in LAYOUTS.items() if w == world]
            cases = [
                {
                    "parallel": {**LAYOUTS[n][1], "micro_batches": MICRO_BATCHES},
                    "updates": SINGLE_UPDATES if n == "single" else ["sapo_r3"],
                    "sft": n == "single",
                }
                for n in names
            ]
            payload = {
                "hf_dir": hf_dir,
                "world": world,
                "sequences": SEQUENCES,
                "budget": BUDGET,
                "cases": cases,
            }
            results = run_distributed(
                "tests.megatron.packing_scenarios:packing_cases", world, payload, timeout=900
            )
            for index, n in enumerate(names):
                cache[n] = [rank[index] for rank in results]
        return cache[name]

    return get


def _merged(ranks: list[dict], run: str, key: str) -> dict[int, torch.Tensor]:
    """``{sequence: values}`` over the ranks that hold ``key`` (the last pipeline stage; TP ranks agree)."""
    merged: dict[int, torch.Tensor] = {}
    for rank in ranks:
        for index, value in rank[run].get(key, {}).items():
            if index in merged:
                torch.testing.assert_close(value, merged[index], atol=LOGP_ATOL, rtol=0)
            merged[index] = value
    return merged


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_micro_batches_run_one_count_and_shape_everywhere(runs, layout):
    ranks = runs(layout)
    shapes = ranks[0]["packed"]["shapes"]  # every rank's list, gathered
    assert all(r["packed"]["shapes"] == shapes for r in ranks)
    assert len({len(rank_shapes) for rank_shapes in shapes}) == 1
    assert len({shape for rank_shapes in shapes for shape in rank_shapes}) == 1
    ((rows, tokens),) = {shape for rank_shapes in shapes for shape in rank_shapes}
    assert rows == 1 and tokens <= BUDGET and len(shapes[0]) >= MICRO_BATCHES
    padded = ranks[0]["padded"]["shapes"]
    assert sum(r * t for rank in shapes for r, t in rank) < sum(r * t for rank in padded for r, t in rank)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_equals_padded(runs, layout):
    ranks = runs(layout)
    for key in ("logp", "entropy"):
        padded, packed = _merged(ranks, "padded", key), _merged(ranks, "packed", key)
        assert sorted(padded) == list(range(SEQUENCES))
        assert _max_diff(padded, packed) <= LOGP_ATOL, key
    padded_routes, packed_routes = (
        _by_rank_and_sequence(ranks, run, "routes") for run in ("padded", "packed")
    )
    assert set(padded_routes) == set(packed_routes)
    for key, routes in padded_routes.items():  # live routing: the same experts per token and layer
        assert torch.equal(routes, packed_routes[key]), key
    # each attention layer's queries after RoPE: RoPE restarts per sequence (relative positions alone would
    # leave the attention unchanged, up to rounding, if it did not)
    padded_q, packed_q = (_by_rank_and_sequence(ranks, run, "queries") for run in ("padded", "packed"))
    assert _max_diff(padded_q, packed_q) <= LOGP_ATOL
    for rank in ranks:
        padded, packed = rank["padded"], rank["packed"]
        (overall, per_layer), (want_overall, want_per_layer) = packed["agreement"], padded["agreement"]
        assert (overall, *per_layer) == pytest.approx((want_overall, *want_per_layer), abs=1e-12)
        assert set(padded["updates"]) == set(packed["updates"])
        for name, update in padded["updates"].items():
            _assert_same_update(update, packed["updates"][name], name)


def _by_rank_and_sequence(ranks: list[dict], run: str, key: str) -> dict[tuple[int, int, int], torch.Tensor]:
    """``{(pipeline stage, TP rank, sequence): values at its loss positions}``: recorded routes (a stage fills
    its own layers) or queries (a TP rank holds its own heads)."""
    return {
        (r["rank"]["pp_rank"], r["rank"]["tp_rank"], index): v
        for r in ranks
        for index, v in r[run][key].items()
    }


def _assert_same_update(padded: dict, packed: dict, name: str) -> None:
    assert packed["loss"] == pytest.approx(padded["loss"], rel=LOSS_RTOL), name
    assert packed["grad_norm"] == pytest.approx(padded["grad_norm"], rel=LOSS_RTOL), name
    assert padded["grad_norm"] > 1e-2
    for metric, value in padded.get("metrics", {}).items():
        assert packed["metrics"][metric] == pytest.approx(value, rel=METRIC_RTOL, abs=METRIC_ATOL), metric
    assert set(packed.get("metrics", {})) == set(padded.get("metrics", {}))
    assert _max_diff(padded["grads"], packed["grads"]) <= GRAD_ATOL, name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_r3_replays_the_engine_routes_into_packed_rows(runs, layout):
    for rank in runs(layout):
        step = rank["packed"]["updates"]["sapo_r3"]
        micro_batches = len(rank["packed"]["shapes"][0])
        calls = step["router_calls"]["calls_per_micro_batch"]
        assert calls and all(per_layer == [1] * micro_batches for per_layer in calls.values())
        assert step["router_calls"]["worst_row_agreement"] == 1.0
        assert step["used"] == 1.0


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "single"])
def test_packed_layout_matches_the_single_process(runs, layout):
    single, ranks = runs("single"), runs(layout)
    logp = _merged(ranks, "packed", "logp")
    assert _max_diff(_merged(single, "padded", "logp"), logp) <= CROSS_LAYOUT_LOGP_ATOL
    ref, got = single[0]["padded"]["updates"]["sapo_r3"], ranks[0]["packed"]["updates"]["sapo_r3"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=CROSS_LAYOUT_RTOL)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=CROSS_LAYOUT_RTOL)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_rows_hold_several_sequences(runs, layout):
    """What makes the equality above non-trivial: a packed row holds several sequences, so per-sequence means,
    GSPO's sequence ratios and the sequence count must come from segments, not rows (single process: also
    GSPO, token-mean GRPO and SFT)."""
    ranks = runs(layout)
    assert max(n for r in ranks for n in r["packed"]["sequences_per_micro_batch"]) >= 2
    if layout == "single":
        assert set(ranks[0]["packed"]["updates"]) == {*SINGLE_UPDATES, "sft"}
        losses = [ranks[0]["packed"]["updates"][name]["loss"] for name in SINGLE_UPDATES]
        assert len({round(x, 6) for x in losses}) == len(losses)
