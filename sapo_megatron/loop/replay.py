"""The RL step's MoE routing: which routes the old-log-prob pass and the policy updates use
(``algorithm.routing_replay``), and the routing metrics. :class:`RoutingStep` owns only routing: the old-policy
pass (:mod:`sapo_megatron.loop.old_policy`) runs its forward through :meth:`RoutingStep.forward_only`, the
``routing_agreement`` pass right after it returns a :class:`RouteAgreement` part, the updates run through
:meth:`RoutingStep.train_step`, and :meth:`RoutingStep.metrics` closes the step.

- ``none``: live routing everywhere.
- ``r2``: the old-log-prob pass records the trainer's live routes; every update of the batch replays them
  (forward and recomputation).
- ``r3``: the rollout engine's routes (``Sample.routed_experts``, laid onto the trainer's positions by
  :mod:`sapo_megatron.model.batching`) are replayed in the old-log-prob pass and in every update.

Metrics, when the engine returns routes (``rollout.routed_experts``): ``routing/agreement`` – the engine's routes
against the trainer's live routing at the rollout's weights (the old-log-prob pass; under R3 one extra recording
forward-only pass), over response token-layers; ``routing/agreement_layer{i}`` per MoE layer;
``routing/agreement_used`` – the routing the updates actually used against the engine's (1.0 under R3 by
construction); for a vision-language model ``routing/agreement_image`` and ``routing/agreement_used_image``, the
same two over the prompts' image tokens (the engine's routes cover the expanded prompt, image pads included, and
must land on the trainer's image positions); ``time/replay_s`` – route handling. The mismatch metrics (k3, |δ|, ratio fractions) come from
``old_logp``, so they see the arm's routing in effect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sapo_megatron.megatron.routing_replay import ENGINE_ROUTES, RECORDED_ROUTES, USED_ROUTES
from sapo_megatron.megatron.train_step import LossFn, OutputFn, StepResult, TrainEngine
from sapo_megatron.model.batching import RouteLayout
from sapo_megatron.model.step_batch import MicroBatch, StepBatch, set_per_micro_batch

REPLAY_SOURCES = {"none": None, "r2": RECORDED_ROUTES, "r3": ENGINE_ROUTES}
IMAGE_TOKENS = "image_token_mask"
"""Micro-batch field of the routing metrics: 1 on input positions that are image tokens (prompt image pads)."""


def needs_route_capture(cfg: Any) -> bool:
    """Whether the trainer's routers must be able to record/replay (built with Megatron's RouterReplay)."""
    return cfg.model.arch.is_moe and (cfg.algorithm.routing_replay != "none" or cfg.rollout.routed_experts)


def route_layout(cfg: Any) -> RouteLayout | None:
    """How engine routes go into micro-batches; None when the engine returns none."""
    return (
        RouteLayout.from_arch(cfg.model.arch)
        if cfg.rollout.routed_experts and cfg.model.arch.is_moe
        else None
    )


@dataclass(frozen=True)
class RouteAgreement:
    """The ``routing_agreement`` pass's part: the live routing against the engine's (metrics), and the image-token
    masks the step's later image metric reuses (None: no image metric)."""

    metrics: Mapping[str, float] = field(default_factory=dict)
    image_tokens: list[torch.Tensor] | None = None

    def apply(self, batch: StepBatch) -> None:
        set_per_micro_batch(batch, IMAGE_TOKENS, self.image_tokens)


class RoutingStep:
    """One RL step's routing: the old-policy pass's :meth:`forward_only`, :meth:`agreement` after it,
    :meth:`train_step` per update, then :meth:`metrics`."""

    def __init__(self, engine: TrainEngine, cfg: Any) -> None:
        self.engine = engine
        self.mode = cfg.algorithm.routing_replay
        self.have_engine_routes = engine.routes is not None and route_layout(cfg) is not None
        arch = cfg.model.arch
        self.image_token_id = arch.image_token_id if arch.is_vl and self.have_engine_routes else None
        engine.take_route_seconds()  # start this step's clock

    def forward_only(self, update: list[MicroBatch], output_fn: OutputFn) -> list[torch.Tensor] | None:
        """One forward-only schedule at the weights that produced the batch, under the arm's routing: R3 replays
        the engine's routes; otherwise the live routes are recorded (``recorded_routes``) when the routers can."""
        replaying_engine = self.mode == "r3"
        record = self.engine.routes is not None and not replaying_engine
        replay_key = ENGINE_ROUTES if replaying_engine else None
        return self.engine.forward_only(update, output_fn, record_routes=record, replay_key=replay_key)

    def agreement(self, batch: StepBatch) -> RouteAgreement:
        """Collective, after the old-policy pass: the engine's routes against the trainer's live routing at the
        rollout's weights (under R3 one extra recording pass), overall, per layer and over the image tokens."""
        if self.mode == "r3":  # the live routing at the rollout's weights, for the metric only
            for update in batch.updates:
                self.engine.forward_only(update, _nothing, record_routes=True)
        micro = batch.micro_batches()
        overall, per_layer = self.engine.routing_agreement(micro, ENGINE_ROUTES, RECORDED_ROUTES)
        metrics = {"routing/agreement": overall}
        metrics.update(
            {f"routing/agreement_layer{i}": v for i, v in enumerate(per_layer) if not math.isnan(v)}
        )
        token_id = self.image_token_id
        if token_id is None:
            return RouteAgreement(metrics)
        image_tokens = [_image_tokens(b, token_id) for b in micro]
        with_mask = [b.copy(image_token_mask=mask) for b, mask in zip(micro, image_tokens)]
        self._image_agreement("routing/agreement_image", with_mask, RECORDED_ROUTES, metrics)
        return RouteAgreement(metrics, image_tokens)

    def train_step(self, update: list[MicroBatch], loss_fn: LossFn) -> StepResult:
        """One policy update with the arm's routes replayed (or live), recording what it used."""
        return self.engine.train_step(
            update, loss_fn, replay_key=REPLAY_SOURCES[self.mode], record_routes=self.have_engine_routes
        )

    def metrics(self, batch: StepBatch) -> dict[str, float]:
        """Collective (every rank), after the updates: the routing the updates used against the engine's, pooled
        over all their tokens, and the time route handling took."""
        metrics: dict[str, float] = {}
        if self.have_engine_routes:
            micro = batch.micro_batches()
            metrics["routing/agreement_used"] = self.engine.routing_agreement(
                micro, USED_ROUTES, ENGINE_ROUTES
            )[0]
            if self.image_token_id is not None:
                self._image_agreement("routing/agreement_used_image", micro, USED_ROUTES, metrics)
        if self.engine.routes is not None:
            metrics["time/replay_s"] = self.engine.take_route_seconds()
        return metrics

    def _image_agreement(self, name: str, micro: list[MicroBatch], key: str, out: dict[str, float]) -> None:
        """Collective: ``key``'s routes against the engine's over the image tokens (logged when there are any)."""
        overall = self.engine.routing_agreement(micro, ENGINE_ROUTES, key, mask_key=IMAGE_TOKENS)[0]
        if not math.isnan(overall):
            out[name] = overall


def _image_tokens(batch: MicroBatch, image_token_id: int) -> torch.Tensor:
    """1 on the prompts' image pads (a pad sampled in a response is text); all 0 in a text-only micro-batch
    (every micro-batch takes part: the metric is reduced over all ranks)."""
    is_pad = torch.eq(batch["input_ids"], image_token_id)
    return is_pad & batch.image_mask.bool() if batch.image_mask is not None else torch.zeros_like(is_pad)


def _nothing(logits: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
    return logits.new_zeros(())
