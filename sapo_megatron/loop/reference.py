"""The reference pass of an RL step (``algorithm.loss.kl_coef > 0`` or ``trainer.log_ref_kl``): forward-only passes
of the frozen reference policy over the whole rollout batch (live routing). Returns :class:`ReferenceLogp`:
``ref_logp`` per micro-batch, on the last pipeline stage, for the loss's KL term and ``kl/k3_ref``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from sapo_megatron.megatron.loss_hook import LogprobOutput
from sapo_megatron.megatron.train_step import ReferenceModel
from sapo_megatron.model.step_batch import StepBatch, last_stage_outputs, set_per_micro_batch


@dataclass(frozen=True)
class ReferenceLogp:
    """The reference policy's log-probs ``[b, s]`` per micro-batch of the step (None off the last stage)."""

    logp: list[torch.Tensor] | None
    metrics: Mapping[str, float] = field(default_factory=dict)

    def apply(self, batch: StepBatch) -> None:
        set_per_micro_batch(batch, "ref_logp", self.logp)


def reference_logp(reference: ReferenceModel, batch: StepBatch, *, temperature: float) -> ReferenceLogp:
    """One forward-only schedule per update (its micro-batches share one padded shape), on every pipeline stage;
    the log-probs on the last one (where the loss runs)."""
    output_fn = LogprobOutput(temperature=temperature)
    per_update = [reference.forward_only(update, output_fn) for update in batch.updates]
    return ReferenceLogp(last_stage_outputs(per_update))
