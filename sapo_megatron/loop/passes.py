"""The passes of an RL step, between building its :class:`~sapo_megatron.model.step_batch.StepBatch` and the
policy updates. Each factory here takes the step's :class:`StepContext` and returns the pass – a function of the
batch that *returns* the part it computes (:class:`~sapo_megatron.model.step_batch.StepPart`) – or None when the run
does not need it. ``STEP_PASSES`` in :mod:`sapo_megatron.loop.trainer` lists them in order; a new capability is one
module with its part and pass, and one line there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from sapo_megatron.loop.old_policy import old_policy_logp
from sapo_megatron.loop.reference import reference_logp
from sapo_megatron.loop.replay import RoutingStep
from sapo_megatron.loop.session import Session
from sapo_megatron.loop.versions import policy_staleness
from sapo_megatron.megatron.loss_hook import IS_WEIGHT_MEAN_KEY, global_is_weight_mean
from sapo_megatron.megatron.train_step import ReferenceModel
from sapo_megatron.model.step_batch import StepBatch, StepPart

StepPass = Callable[[StepBatch], StepPart]
"""A pass: the step's batch in, the part it computes out (the step applies it)."""


@dataclass(frozen=True)
class StepContext:
    """What the passes of one RL step may use: the run, the step's routing, the frozen reference policy and the
    trainer's policy version at the start of the step (``version``: RL steps done before it)."""

    session: Session
    routing: RoutingStep
    reference: ReferenceModel | None
    version: int = 0


PassFactory = Callable[[StepContext], StepPass | None]
"""A registered pass: the pass for this step, or None when the run does not need it."""


def old_policy(ctx: StepContext) -> StepPass | None:
    """``old_logp`` (and ``old_logp_t1`` when distilling at a rollout temperature ≠ 1) under the arm's routing;
    skipped under ``algorithm.proximal_logp: loglinear`` (the loss hook approximates the proximal log-prob)."""
    cfg = ctx.session.cfg
    if cfg.algorithm.proximal_logp == "loglinear":
        return None
    temperature = cfg.rollout.temperature
    unit = (
        bool(cfg.teachers) and temperature != 1.0
    )  # teachers score at 1: A_opd needs the student's log-prob there
    return partial(old_policy_logp, ctx.routing, temperature=temperature, unit_temperature=unit)


def staleness(ctx: StepContext) -> StepPass:
    """Each response token's staleness from its policy version (sequences that carry versions)."""
    return partial(policy_staleness, trainer_version=ctx.version)


def routing_agreement(ctx: StepContext) -> StepPass | None:
    """The live routing against the engine's (and the image-token masks), when the engine returned routes."""
    return ctx.routing.agreement if ctx.routing.have_engine_routes else None


def reference(ctx: StepContext) -> StepPass | None:
    """``ref_logp`` from the frozen reference policy (``kl_coef > 0`` or ``trainer.log_ref_kl``)."""
    if ctx.reference is None:
        return None
    return partial(reference_logp, ctx.reference, temperature=ctx.session.cfg.rollout.temperature)


def teacher_fusion(ctx: StepContext) -> StepPass:
    """Teacher advantages fused into ``advantages`` (OPD, SAF, MOPD); a no-op part without teachers."""
    return ctx.session.distill.fuse


@dataclass(frozen=True)
class IsWeightMean:
    """The step's batch mean of the ``rollout_corr`` IS weights, into every micro-batch (None: none to set)."""

    mean: torch.Tensor | None
    metrics: Mapping[str, float] = field(default_factory=dict)

    def apply(self, batch: StepBatch) -> None:
        if self.mean is None:
            return
        for micro in batch.micro_batches():
            micro[IS_WEIGHT_MEAN_KEY] = self.mean


def rollout_corr_norm(ctx: StepContext) -> StepPass | None:
    """verl's ``rollout_is_batch_normalize``: the mean of the truncated IS weights over the whole rollout batch
    (every update, every data-parallel rank), which the loss divides them by; only for a ``rollout_corr``
    correction with ``is_batch_normalize``."""
    cfg = ctx.session.cfg
    correction = ctx.session.distill.correction(cfg.algorithm.correction)
    if not getattr(correction, "is_batch_normalize", False):
        return None
    return lambda batch: IsWeightMean(global_is_weight_mean(correction, batch.micro_batches()))
