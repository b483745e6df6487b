"""The policy-version pass of an RL step (asynchronous rollouts): each response token's staleness – how many
policy versions the trainer is ahead of the weights that sampled it – from the micro-batches' ``versions``.

Returns :class:`TokenStaleness`, which sets ``staleness`` (fp32 ``[b, s]``, 0 off the response) on every
micro-batch that has ``versions``; the loss hook reads it for the loglinear proximal approximation
(:func:`~sapo_megatron.algo.decoupled.loglinear_proximal_logp`). The staleness metrics are made from the whole
batch by the rollout pipeline (every rank holds every sequence), see :mod:`sapo_megatron.loop.fully_async`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from sapo_megatron.model.step_batch import StepBatch


@dataclass(frozen=True)
class TokenStaleness:
    """``trainer_version``: the version of the trainer's weights at the start of the step (the proximal policy)."""

    trainer_version: int
    metrics: Mapping[str, float] = field(default_factory=dict)

    def apply(self, batch: StepBatch) -> None:
        for micro in batch.micro_batches():
            if micro.versions is not None:
                micro.staleness = token_staleness(micro.versions, self.trainer_version)


def token_staleness(versions: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """fp32 ``trainer_version − versions`` where ``versions >= 0`` (response tokens), else 0."""
    return torch.where(versions >= 0, trainer_version - versions, 0).float()


def policy_staleness(batch: StepBatch, *, trainer_version: int) -> TokenStaleness:
    return TokenStaleness(trainer_version)
