"""One RL step's metrics pooled over its updates: token-weighted (a mini-batch without positive-advantage tokens
no longer drags ``sapo/w_mean_pos`` towards 0), per update as ``mb{i}/...``, and the step's ratio quantiles."""

from __future__ import annotations

import pytest
import torch

from sapo_megatron.loop.step_metrics import StepMetrics, quantiles, ratio_quantiles
from sapo_megatron.megatron.train_step import StepResult


def result(sums: dict[str, tuple[float, float]], per_update: frozenset[str] = frozenset()) -> StepResult:
    means = {name: total / max(weight, 1e-12) for name, (total, weight) in sums.items()}
    return StepResult(
        loss=0.0,
        grad_norm=1.0,
        lr=1e-3,
        update_successful=True,
        metrics=means,
        metric_sums=sums,
        per_update=per_update,
    )


DIAGNOSTICS = frozenset({"sapo/w_mean_pos", "sapo/w_mean", "policy/kl_old"})


def test_updates_pool_by_their_token_counts_and_keep_per_update_values():
    # Update 0: 30 positive tokens gated at 0.9; update 1: no positive token (the engine's mean reads 0).
    first = result(
        {
            "sapo/w_mean_pos": (27.0, 30.0),
            "sapo/w_mean": (45.0, 50.0),
            "policy/kl_old": (0.0, 50.0),
            "entropy": (100.0, 50.0),
        },
        DIAGNOSTICS,
    )
    second = result(
        {"sapo/w_mean_pos": (0.0, 0.0), "sapo/w_mean": (14.0, 20.0), "policy/kl_old": (0.2, 20.0)},
        DIAGNOSTICS,
    )
    pooled = StepMetrics(updates=2)
    pooled.add(first)
    pooled.add(second)
    metrics = pooled.finish()
    assert metrics["sapo/w_mean_pos"] == pytest.approx(0.9)  # averaging the updates' means gave 0.45
    assert metrics["sapo/w_mean"] == pytest.approx(59.0 / 70.0)
    assert metrics["policy/kl_old"] == pytest.approx(0.2 / 70.0)
    assert metrics["mb0/sapo/w_mean"] == pytest.approx(0.9) and metrics["mb1/sapo/w_mean"] == pytest.approx(
        0.7
    )
    assert metrics["mb1/policy/kl_old"] == pytest.approx(0.01) and "mb1/sapo/w_mean_pos" not in metrics
    assert metrics["entropy"] == pytest.approx(2.0) and "mb0/entropy" not in metrics  # not a per-update one
    no_positive = StepMetrics(updates=1)
    no_positive.add(second)
    assert "sapo/w_mean_pos" not in no_positive.finish()  # not measured this step, rather than a 0
    one = StepMetrics(updates=1)
    one.add(first)
    assert not any(name.startswith("mb") for name in one.finish())  # one update: nothing to split


def test_ratio_quantiles_over_the_steps_tokens():
    gen = torch.Generator().manual_seed(0)
    parts = [torch.rand(1000, generator=gen) + 0.5, torch.rand(37, generator=gen) * 3.0]
    pooled = StepMetrics(updates=2)
    pooled.add(result({}))
    metrics = pooled.finish(parts)
    every = torch.cat(parts).double()
    for name, level in (("p0.1", 0.001), ("p1", 0.01), ("p50", 0.5), ("p99", 0.99), ("p99.9", 0.999)):
        assert metrics[f"ratio/{name}"] == pytest.approx(float(torch.quantile(every, level)), rel=1e-9), name
    assert (metrics["ratio/min"], metrics["ratio/max"]) == (float(every.min()), float(every.max()))
    assert quantiles(torch.tensor([1.0, 2.0, 3.0, 4.0]), [0.0, 0.5, 1.0]) == [1.0, 2.5, 4.0]
    assert ratio_quantiles(torch.zeros(0)) == {}
