"""CISPO, GMPO, DPPO (TV, KL) and M2PO inside Megatron training steps on tiny Qwen3-MoE, with TIS composed: the
same loss, metrics and updated weights for 1 vs 4 micro-batches and under TP2+SP, PP2, DP2, EP2 and CP2 as in a single
process (the SAPO versions of these checks are tests/loss/test_megatron_hook.py, whose data this reuses).

M2PO's mask is taken per micro-batch, as in AReaL: the step is layout-invariant only where it drops nothing,
which is what these cases check (``m2po/frac_masked`` = 0); ``m2po-drop`` shows a step that does drop tokens."""

from __future__ import annotations

import pytest

from tests.loss.test_megatron_hook import (  # noqa: F401 (fixtures)
    TIS,
    _assert_same_step,
    _merge,
    _spawn,
    data,
    hf_dir,
)

# Thresholds small enough to act on a random 64-token model (token probabilities ~1/64).
BASELINES = {
    "cispo": {"name": "cispo", "max_ratio": 1.5, "kl_coef": 0.01},
    "gmpo": {"name": "gmpo", "clip_low": 0.2, "clip_high": 0.2, "entropy_coef": 0.01},
    "dppo_tv": {"name": "dppo_tv", "delta_low": 0.004, "delta_high": 0.004, "agg": "seq-mean-token-mean"},
    "dppo_kl": {"name": "dppo_kl", "delta_low": 5e-5, "delta_high": 5e-5, "ratio_cap": 2.0},
    "m2po": {"name": "m2po"},
}
LAYOUTS = {
    "tp2-sp": {"tp": 2, "sequence_parallel": True, "micro_batches": 2},
    "pp2": {"pp": 2, "micro_batches": 4},
    "dp2": {"micro_batches": 2},
    "ep2": {"ep": 2, "micro_batches": 2},  # DP2 with the experts split over the two ranks
    "cp2": {"cp": 2, "micro_batches": 2},  # each sequence in 4 chunks over the two ranks
}


def _case(loss, parallel):
    return {"parallel": parallel, "loss": loss, "correction": TIS}


@pytest.fixture(scope="module")
def single(hf_dir, data):  # noqa: F811
    cases = {
        f"{n}-mb{mb}": _case(loss, {"micro_batches": mb}) for n, loss in BASELINES.items() for mb in (1, 4)
    }
    cases["m2po-drop"] = _case({"name": "m2po", "m2_threshold": 0.005}, {"micro_batches": 1})
    results = _spawn(hf_dir, data, 1, list(cases.values()))
    return {name: _merge(ranks) for name, ranks in zip(cases, results)}


@pytest.fixture(scope="module")
def two_procs(hf_dir, data):  # noqa: F811
    cases = {f"{n}-{lay}": _case(loss, LAYOUTS[lay]) for n, loss in BASELINES.items() for lay in LAYOUTS}
    results = _spawn(hf_dir, data, 2, list(cases.values()))
    return dict(zip(cases, results))


@pytest.mark.parametrize("name", list(BASELINES))
def test_micro_batch_split_does_not_change_the_step(single, name):
    one = single[f"{name}-mb1"]
    _assert_same_step(one, single[f"{name}-mb4"])
    assert one["grad_norm"] > 1e-3
    assert one["metrics"]["mismatch/is_weight_mean"] != pytest.approx(1.0)  # TIS is composed


@pytest.mark.parametrize("name", list(BASELINES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(single, two_procs, name, layout):
    _assert_same_step(single[f"{name}-mb1"], _merge(two_procs[f"{name}-{layout}"]))


def test_the_diagnostics_act_on_this_data(single):
    metrics = {name: single[f"{name}-mb1"]["metrics"] for name in BASELINES}
    assert metrics["cispo"]["clip/frac_high"] > 0
    assert metrics["gmpo"]["clip/frac"] > 0
    assert 0 < metrics["dppo_tv"]["clip/frac"] < 1
    assert 0 < metrics["dppo_kl"]["clip/frac"] < 1 and metrics["dppo_kl"]["dppo/frac_ratio_capped"] > 0
    assert metrics["m2po"]["m2po/frac_masked"] == 0  # why m2po is layout-invariant here
    dropped = single["m2po-drop"]
    assert 0 < dropped["metrics"]["m2po/frac_masked"] < 1 and dropped["grad_norm"] > 1e-3
