"""Metrics that carry their own reduction: each one says, where it is made, how its values from several
micro-batches and ranks combine into the step's value – never inferred from its name.

A :class:`MetricSet` reads like a ``Mapping[str, value]`` (``metrics["sapo/w_mean"]``), and
:meth:`MetricSet.reduction` tells how each entry pools. The policy loss hook turns each into the engine's
``(weighted sum, weight)`` pair with the weight its reduction names (:mod:`sapo_megatron.megatron.loss_hook`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum

import torch

Value = torch.Tensor | float


class Reduce(Enum):
    """How a metric's per-micro-batch values combine into the step's value."""

    SUM = "sum"
    """The value is already this micro-batch's share of the full-batch total (``loss/*``): summed."""
    TOKEN_MEAN = "token_mean"
    """A mean over the micro-batch's response tokens: pooled weighted by their count."""
    SEQUENCE_MEAN = "sequence_mean"
    """A mean over the micro-batch's sequences with a response token: pooled weighted by their count."""
    POS_TOKEN_MEAN = "pos_token_mean"
    """A mean over the response tokens with a positive advantage."""
    NEG_TOKEN_MEAN = "neg_token_mean"
    """A mean over the response tokens with a negative advantage."""
    MIN = "min"
    """An extremum: a ``(weighted sum, weight)`` pair cannot carry it, so the engine does not pool it."""
    MAX = "max"
    """An extremum, as :attr:`MIN`."""


@dataclass(frozen=True)
class Metric:
    """One value and how it pools; ``per_update``: a policy diagnostic whose value per optimizer update an RL step
    of several updates logs too (``mb{i}/<name>``)."""

    value: Value
    reduce: Reduce
    per_update: bool = False


class MetricSet(Mapping[str, Value]):
    """Named metrics, each with its :class:`Reduce`; reads as a mapping of name → value, in insertion order."""

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}

    def add(self, name: str, value: Value, reduce: Reduce, *, per_update: bool = False) -> None:
        self._metrics[name] = Metric(value, reduce, per_update)

    def update(self, other: MetricSet) -> None:
        self._metrics.update(other._metrics)

    def reduction(self, name: str) -> Reduce:
        return self._metrics[name].reduce

    def items_with_reduction(self) -> Iterator[tuple[str, Metric]]:
        yield from self._metrics.items()

    def __getitem__(self, name: str) -> Value:
        return self._metrics[name].value

    def __iter__(self) -> Iterator[str]:
        return iter(self._metrics)

    def __len__(self) -> int:
        return len(self._metrics)

    def __repr__(self) -> str:
        return f"MetricSet({ {name: (m.value, m.reduce.value) for name, m in self._metrics.items()} })"


def metric_set(values: Mapping[str, Value], reduce: Reduce, *, per_update: bool = False) -> MetricSet:
    """A :class:`MetricSet` of ``values``, all pooled by ``reduce`` (and all per update, or none)."""
    out = MetricSet()
    for name, value in values.items():
        out.add(name, value, reduce, per_update=per_update)
    return out
