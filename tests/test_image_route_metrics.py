"""The image-token routing metrics of the RL step (``loop/replay.RoutingStep``): they count the prompts' image
pads only – not an image pad the policy sampled in a response (text to the engines), not a pad in a text-only
micro-batch – and compare the engine's routes with the trainer's recorded and used ones there. The engine here is
a stand-in for :class:`~sapo_megatron.megatron.train_step.TrainEngine` that computes the agreement of this rank's
micro-batches as its ``routing_agreement`` does without the all-reduce (one rank); the collective path runs end
to end in tests/rl/test_vl_loop.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sapo_megatron.loop.old_policy import old_policy_logp
from sapo_megatron.loop.replay import RoutingStep
from sapo_megatron.megatron.routing import agreement_counts, agreement_from_counts
from sapo_megatron.megatron.routing_replay import ENGINE_ROUTES, RECORDED_ROUTES, USED_ROUTES
from sapo_megatron.model.arch import QwenArch
from sapo_megatron.model.batching import IMAGE_MASK
from sapo_megatron.model.step_batch import MicroBatch, StepBatch
from sapo_megatron.model.tiny import tiny_hf_config, tiny_vl_hf_config

ARCH = QwenArch.from_hf_dict(tiny_vl_hf_config())
PAD = ARCH.image_token_id
LAYERS = ARCH.num_hidden_layers


class OneRankEngine:
    routes = object()  # routes are captured

    def take_route_seconds(self) -> float:
        return 0.0

    def forward_only(self, update, output_fn, **kwargs):
        return None  # the routes are already in the batches; no log-probs needed here

    def routing_agreement(self, batches, key_a, key_b, mask_key="loss_mask"):
        counts = [torch.stack(agreement_counts(b[key_a], b[key_b], b[mask_key])) for b in batches]
        return agreement_from_counts(*torch.stack(counts).sum(0))


def _routes(batch_size: int, seq: int) -> torch.Tensor:
    """Distinct top-2 sets per position and layer: ``[b, s, L, 2]``."""
    first = torch.arange(batch_size * seq * LAYERS).reshape(batch_size, seq, LAYERS, 1) % 3
    return torch.cat([first, first + 1], -1)


def _batch(ids: list[list[int]], image_mask: list[list[int]] | None) -> MicroBatch:
    input_ids = torch.tensor(ids)
    engine = _routes(*input_ids.shape)
    batch = {
        "input_ids": input_ids,
        "loss_mask": torch.ones(input_ids.shape),
        ENGINE_ROUTES: engine,
        RECORDED_ROUTES: engine.clone(),
        USED_ROUTES: engine.clone(),
    }
    if image_mask is not None:
        batch[IMAGE_MASK] = torch.tensor(image_mask, dtype=torch.float32)
    return MicroBatch.of(batch)


def _moved(routes: torch.Tensor, row: int, pos: int, layer: int | None = None) -> None:
    """Another expert set at ``(row, pos)`` (one layer or all)."""
    layers = slice(None) if layer is None else slice(layer, layer + 1)
    routes[row, pos, layers] = routes[row, pos, layers] + 3


def test_image_agreement_counts_the_prompts_image_pads_only():
    # row 0: a prompt with two image pads, a response that sampled a pad; row 1: a text-only sequence
    with_images = _batch([[5, PAD, PAD, 6, PAD, 7], [5, 6, PAD, 8, 9, 9]], [[1, 1, 1, 1, 0, 0], [0] * 6])
    text_only = _batch([[5, PAD, 7, 8]], None)  # a micro-batch without images: its pad was sampled
    _moved(with_images[RECORDED_ROUTES], 0, 1, layer=0)  # one of the 2 × 3 image token-layers differs
    for batch, row, pos in (
        (with_images, 0, 4),
        (with_images, 1, 2),
        (text_only, 0, 1),
    ):  # pads that are text
        _moved(batch[RECORDED_ROUTES], row, pos)
        _moved(batch[USED_ROUTES], row, pos)
    metrics = _step_metrics(StepBatch([[with_images], [text_only]]), _r2_config(ARCH))
    assert metrics["routing/agreement_image"] == pytest.approx(5 / 6)
    assert metrics["routing/agreement_used_image"] == 1.0
    assert metrics["routing/agreement"] < 1.0  # the response's sampled pads do count there


def test_no_image_metrics_without_images_or_for_a_text_model():
    cfg = _r2_config(ARCH)
    metrics = _step_metrics(StepBatch([[_batch([[5, PAD, 7, 8]], None)]]), cfg)
    assert not {"routing/agreement_image", "routing/agreement_used_image"} & set(metrics)
    text = QwenArch.from_hf_dict(tiny_hf_config("moe"))
    cfg.model = SimpleNamespace(arch=text)
    assert RoutingStep(OneRankEngine(), cfg).image_token_id is None


def _step_metrics(batch: StepBatch, cfg: SimpleNamespace) -> dict[str, float]:
    """The routing passes of an RL step (old policy, then agreement), then its routing metrics."""
    routing = RoutingStep(OneRankEngine(), cfg)
    batch.add(old_policy_logp(routing, batch, temperature=1.0, unit_temperature=False))
    metrics = batch.add(routing.agreement(batch))
    return {**metrics, **routing.metrics(batch)}


def _r2_config(arch: QwenArch) -> SimpleNamespace:
    """What RoutingStep reads of a run's config: R2 with the engine's routes, no teachers."""
    return SimpleNamespace(
        algorithm=SimpleNamespace(routing_replay="r2"),
        rollout=SimpleNamespace(temperature=1.0, routed_experts=True),
        teachers=[],
        model=SimpleNamespace(arch=arch),
    )
