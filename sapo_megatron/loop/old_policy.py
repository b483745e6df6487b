"""The old-policy pass of an RL step: forward-only passes with the weights that produced the batch, under the arm's
routing (:meth:`~sapo_megatron.loop.replay.RoutingStep.forward_only`: R2 records the routes its updates replay, R3
replays the engine's). Returns :class:`OldPolicyLogp`: ``old_logp`` per micro-batch at the rollout temperature
(last pipeline stage only, where the loss runs), and, when distilling at a rollout temperature ≠ 1, ``old_logp_t1``
from the same forward at temperature 1 – what the teachers score at, so what ``A_opd`` compares.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from sapo_megatron.loop.replay import RoutingStep
from sapo_megatron.megatron.loss_hook import LogprobOutput
from sapo_megatron.model.batching import UNIT_TEMPERATURE_LOGP
from sapo_megatron.model.step_batch import StepBatch, last_stage_outputs, set_per_micro_batch


@dataclass(frozen=True)
class OldPolicyLogp:
    """Per micro-batch of the step (None off the last pipeline stage): the old policy's log-probs ``[b, s]`` at
    the rollout temperature, and at temperature 1 (None unless distilling at a temperature ≠ 1)."""

    logp: list[torch.Tensor] | None
    unit_temperature: list[torch.Tensor] | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)

    def apply(self, batch: StepBatch) -> None:
        set_per_micro_batch(batch, "old_logp", self.logp)
        set_per_micro_batch(batch, UNIT_TEMPERATURE_LOGP, self.unit_temperature)


def old_policy_logp(
    routing: RoutingStep, batch: StepBatch, *, temperature: float, unit_temperature: bool
) -> OldPolicyLogp:
    """One forward-only schedule per update (its micro-batches share one padded shape), on every pipeline stage."""
    output_fn = LogprobOutput(temperature=temperature, with_unit_temperature=unit_temperature)
    per_update = [routing.forward_only(update, output_fn) for update in batch.updates]
    logp = last_stage_outputs(per_update)
    if logp is None:  # not the last pipeline stage: the loss does not run here
        return OldPolicyLogp(None)
    if not unit_temperature:
        return OldPolicyLogp(logp)
    pairs = [stacked.unbind(0) for stacked in logp]  # [2, b, s]: at the rollout temperature, at 1
    return OldPolicyLogp([p[0] for p in pairs], [p[1] for p in pairs])
