"""One RL step's training metrics pooled over its ``mini_batches`` optimizer updates.

Each update reports ``(weighted sum, weight)`` per metric (``StepResult.metric_sums``: token, sequence or
sign-of-advantage counts over every micro-batch and rank); the step's value is the sum of the sums over the sum of
the weights, so a mini-batch without positive-advantage tokens adds nothing to ``sapo/w_mean_pos`` instead of
counting as 0, and a metric with no weight at all (a step, or an update, without positive-advantage tokens) is
left out rather than logged as 0. With several updates, the per-update values of the policy diagnostics – the
metrics the loss made with ``per_update`` (``StepResult.per_update``): ``ratio/mean``, ``clip/*``, ``sapo/*``,
``policy/kl_old`` – are kept as ``mb{i}/<name>`` (``i`` from 0). The token ratios of the whole step give
``ratio/p0.1``, ``ratio/p1``, ``ratio/p50``, ``ratio/p99``, ``ratio/p99.9``, ``ratio/min``, ``ratio/max`` (quantiles
with linear interpolation, as ``torch.quantile``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sapo_megatron.megatron.step_stats import gather_token_values
from sapo_megatron.megatron.train_step import StepResult

RATIO_QUANTILES = {"p0.1": 0.001, "p1": 0.01, "p50": 0.5, "p99": 0.99, "p99.9": 0.999}


class StepMetrics:
    """Call :meth:`add` with each update's result in order, then :meth:`finish` (collective) once."""

    def __init__(self, updates: int) -> None:
        self.updates = updates
        self._sums: dict[str, list[float]] = {}
        self._per_update: dict[str, float] = {}
        self._index = 0

    def add(self, result: StepResult) -> None:
        sums = result.metric_sums or {name: (value, 1.0) for name, value in result.metrics.items()}
        for name, (total, weight) in sums.items():
            pooled = self._sums.setdefault(name, [0.0, 0.0])
            pooled[0] += total
            pooled[1] += weight
            if self.updates > 1 and name in result.per_update and weight > 0:
                self._per_update[f"mb{self._index}/{name}"] = total / weight
        self._index += 1

    def finish(self, ratios: Sequence[torch.Tensor] = ()) -> dict[str, float]:
        """The step's metrics; ``ratios``: this rank's token ratios of every update (``PolicyLossHook.take_ratios``),
        pooled over the data-parallel ranks (every rank must call this)."""
        metrics = {name: total / weight for name, (total, weight) in self._sums.items() if weight > 0}
        metrics.update(self._per_update)
        metrics.update(ratio_quantiles(gather_token_values(ratios)))
        return metrics


def ratio_quantiles(ratios: torch.Tensor) -> dict[str, float]:
    """``ratio/p0.1`` … ``ratio/p99.9``, ``ratio/min``, ``ratio/max`` of a 1-d tensor; {} when it is empty."""
    if ratios.numel() == 0:
        return {}
    values = quantiles(ratios, list(RATIO_QUANTILES.values()))
    out = {f"ratio/{name}": value for name, value in zip(RATIO_QUANTILES, values)}
    out["ratio/min"], out["ratio/max"] = float(ratios.min()), float(ratios.max())
    return out


def quantiles(values: torch.Tensor, levels: Sequence[float]) -> list[float]:
    """``torch.quantile(values, q)`` (linear interpolation) for each level, without its 16M-element limit."""
    ordered = values.double().sort().values
    last = ordered.numel() - 1
    out = []
    for q in levels:
        position = q * last
        low = int(position)
        high = min(low + 1, last)
        frac = position - low
        out.append(float(ordered[low] + (ordered[high] - ordered[low]) * frac))
    return out
