"""The RL step's MoE routing: which routes the old-log-prob pass and the policy updates use
(``algorithm.routing_replay``), and the routing metrics, in one object the trainer calls at three points.

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
from collections.abc import Callable

import torch

from sapo_megatron.megatron.loss_hook import LogprobOutput
from sapo_megatron.megatron.routing_replay import ENGINE_ROUTES, RECORDED_ROUTES, USED_ROUTES
from sapo_megatron.megatron.train_step import StepResult, TrainEngine
from sapo_megatron.model.batching import IMAGE_MASK, UNIT_TEMPERATURE_LOGP, RouteLayout

REPLAY_SOURCES = {"none": None, "r2": RECORDED_ROUTES, "r3": ENGINE_ROUTES}
Updates = list[list[dict]]
IMAGE_TOKENS = "image_token_mask"
"""Micro-batch key of the routing metrics: 1 on input positions that are image tokens (prompt image pads)."""


def needs_route_capture(cfg) -> bool:
    """Whether the trainer's routers must be able to record/replay (built with Megatron's RouterReplay)."""
    return cfg.model.arch.is_moe and (cfg.algorithm.routing_replay != "none" or cfg.rollout.routed_experts)


def route_layout(cfg) -> RouteLayout | None:
    """How engine routes go into micro-batches; None when the engine returns none."""
    return (
        RouteLayout.from_arch(cfg.model.arch)
        if cfg.rollout.routed_experts and cfg.model.arch.is_moe
        else None
    )


class RoutingStep:
    """One RL step's routing: call :meth:`old_logp` once, :meth:`train_step` per update, then :meth:`metrics`."""

    def __init__(self, engine: TrainEngine, cfg) -> None:
        self.engine = engine
        self.mode = cfg.algorithm.routing_replay
        self.temperature = cfg.rollout.temperature
        # Distilling at a rollout temperature ≠ 1: A_opd needs the student's log-prob at 1, as teachers score.
        self.unit_logp = bool(cfg.teachers) and self.temperature != 1.0
        self.have_engine_routes = engine.routes is not None and route_layout(cfg) is not None
        arch = cfg.model.arch
        self.image_token_id = arch.image_token_id if arch.is_vl and self.have_engine_routes else None
        self._updates: Updates = []
        self._metrics: dict[str, float] = {}
        engine.take_route_seconds()  # start this step's clock

    def old_logp(self, updates: Updates) -> None:
        """Forward-only passes with the weights that produced the batch: ``old_logp`` in every micro-batch (last
        pipeline stage), under the arm's routing; the live-agreement metric when the engine returned routes."""
        self._updates = updates
        replaying_engine = self.mode == "r3"
        record = self.engine.routes is not None and not replaying_engine
        output_fn = LogprobOutput(temperature=self.temperature, with_unit_temperature=self.unit_logp)
        _attach(self.engine, updates, "old_logp", output_fn, record, self.mode)
        if self.unit_logp:
            for batch in _flat(updates):
                if "old_logp" in batch:
                    batch["old_logp"], batch[UNIT_TEMPERATURE_LOGP] = batch["old_logp"].unbind(0)
        if not self.have_engine_routes:
            return
        if replaying_engine:  # the live routing at the rollout's weights, for the metric only
            for update in updates:
                self.engine.forward_only(update, _nothing, record_routes=True)
        overall, per_layer = self.engine.routing_agreement(_flat(updates), ENGINE_ROUTES, RECORDED_ROUTES)
        self._metrics["routing/agreement"] = overall
        self._metrics.update(
            {f"routing/agreement_layer{i}": v for i, v in enumerate(per_layer) if not math.isnan(v)}
        )
        self._image_agreement("routing/agreement_image", RECORDED_ROUTES)

    def train_step(self, update: list[dict], loss_fn: Callable) -> StepResult:
        """One policy update with the arm's routes replayed (or live), recording what it used."""
        return self.engine.train_step(
            update, loss_fn, replay_key=REPLAY_SOURCES[self.mode], record_routes=self.have_engine_routes
        )

    def metrics(self) -> dict[str, float]:
        """Collective (every rank): the step's routing metrics, pooled over all its updates' tokens."""
        metrics = dict(self._metrics)
        if self.have_engine_routes:
            used = self.engine.routing_agreement(_flat(self._updates), USED_ROUTES, ENGINE_ROUTES)[0]
            metrics["routing/agreement_used"] = used
            self._image_agreement("routing/agreement_used_image", USED_ROUTES, metrics)
        if self.engine.routes is not None:
            metrics["time/replay_s"] = self.engine.take_route_seconds()
        return metrics

    def _image_agreement(self, name: str, key: str, out: dict[str, float] | None = None) -> None:
        """Collective: ``key``'s routes against the engine's over the image tokens (logged when there are any)."""
        if self.image_token_id is None:
            return
        batches = _flat(self._updates)
        for batch in batches:  # every micro-batch, text-only ones too: the metric is reduced over all ranks
            if IMAGE_TOKENS in batch:  # set by the step's first call (old_logp), for the same batches
                continue
            is_pad = batch["input_ids"] == self.image_token_id  # a pad sampled in a response is text
            batch[IMAGE_TOKENS] = (
                is_pad & batch[IMAGE_MASK].bool() if IMAGE_MASK in batch else torch.zeros_like(is_pad)
            )
        overall = self.engine.routing_agreement(batches, ENGINE_ROUTES, key, mask_key=IMAGE_TOKENS)[0]
        if not math.isnan(overall):
            (self._metrics if out is None else out)[name] = overall


def _attach(engine: TrainEngine, updates: Updates, key: str, output_fn, record: bool, mode: str) -> None:
    replay_key = ENGINE_ROUTES if mode == "r3" else None
    for update in updates:  # one schedule per update: its micro-batches share one padded shape
        outputs = engine.forward_only(update, output_fn, record_routes=record, replay_key=replay_key)
        if outputs is None:  # not the last pipeline stage
            continue
        for batch, value in zip(update, outputs):
            batch[key] = value


def _flat(updates: Updates) -> list[dict]:
    return [batch for update in updates for batch in update]


def _nothing(logits, batch):
    return logits.new_zeros(())
