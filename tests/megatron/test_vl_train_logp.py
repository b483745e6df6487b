"""Training on images: the trainer's log-probs of CPU-engine rollouts with images equal the engine's own
(fp32, single process), for padded and for packed micro-batches. The engine (transformers' Qwen3-VL-MoE) and the
Megatron VL model hold the same weights; the trainer re-processes the prompt's PNG images with the checkpoint's
image processor, as the engine does, so both see the same ``pixel_values`` and grids."""

from __future__ import annotations

# megatron-core 0.19 imports triton at import time unless sapo_megatron's stand-ins are registered first
import sapo_megatron.megatron  # noqa: F401  # isort: skip

import dataclasses
import json

import pytest
import torch

from sapo_megatron.algo import AdvantageConfig
from sapo_megatron.checkpoint.fused_experts import unfuse
from sapo_megatron.config import config_from_dict
from sapo_megatron.data.vision import pixel_inputs
from sapo_megatron.megatron.model import BuildOptions, build_gpt_model
from sapo_megatron.megatron.packed_seq import model_inputs
from sapo_megatron.megatron.parallel import parallel_context
from sapo_megatron.megatron.weights import load_hf_weights
from sapo_megatron.model.batching import IMAGE_GRID_THW, TrainSequence, build_micro_batches
from sapo_megatron.rollout.collect import CollectSettings, generate_groups
from sapo_megatron.rollout.cpu.engine import CPUEngine
from sapo_megatron.rollout.types import SamplingParams
from tests.vl_fixtures import build_tiny_vl_checkpoint, vl_prompts

LOGP_ATOL = 1e-5
"""fp32 bound on |trainer logp - engine logp| per response token (the brief expects ~1e-6)."""


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """Eight samples per prompt from the CPU engine (one image; two images of other sizes; text only), as
    TrainSequences carrying the images the trainer computes, and the engine's checkpoint directory."""
    directory = build_tiny_vl_checkpoint(tmp_path_factory.mktemp("vl"))
    renderer, rows, spec = vl_prompts(directory)
    settings = CollectSettings(
        n_samples=8,
        sampling=SamplingParams(max_new_tokens=8, temperature=1.0, seed=5),
        advantage=AdvantageConfig(),
        image_pad_id=spec.pad_id,
    )
    engine = CPUEngine.from_pretrained(directory, seed=0)
    groups = generate_groups(engine, rows, renderer.encode, settings, seed=3)
    sequences = []
    for row, group in zip(rows, groups):
        images = pixel_inputs(spec.processor, [image.load() for image in row.images]) if row.images else None
        for sample in group:
            sequences.append(
                TrainSequence(
                    sample.prompt_ids,
                    sample.response_ids,
                    rollout_logp=sample.rollout_logp,
                    sample_id=f"group {sample.group_id} sample {sample.sample_index}",
                    images=images,
                )
            )
    # the random policy samples <|image_pad|> once on these seeds: text to the engine, and so to the trainer
    assert sum(list(s.response_ids).count(spec.pad_id) for s in sequences) >= 1
    yield directory, sequences, engine
    engine.close()


@pytest.fixture(scope="module")
def build_trainer_model(rollouts):
    """Single-process Megatron state for the module, and a builder of Megatron VL models holding the engine's
    initial weights (``freeze_vision`` as asked)."""
    directory = rollouts[0]
    import transformers

    hf_config = json.loads((directory / "config.json").read_text())
    weights = unfuse(
        transformers.AutoModelForImageTextToText.from_pretrained(str(directory)).float().state_dict()
    )
    cfg = config_from_dict({"model": {"hf_config": hf_config}, "launch": {"procs_per_node": 1}})
    with parallel_context(cfg):

        def build(**model):
            module = build_gpt_model(
                BuildOptions(cfg.model.model_copy(update=model), cfg.parallel, cfg.precision)
            )
            load_hf_weights(module, weights.__getitem__, cfg.model.arch)
            return module.eval()

        yield build


@pytest.fixture(scope="module")
def trainer_model(build_trainer_model):
    return build_trainer_model()


def _trainer_logp(model, batch) -> torch.Tensor:
    with torch.no_grad(), model_inputs(model, batch) as inputs:
        logits = model(batch["input_ids"], **inputs)
    return torch.log_softmax(logits.float(), -1).gather(-1, batch["labels"][..., None]).squeeze(-1)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_trainer_logp_on_images_equals_the_engines(rollouts, trainer_model, packed):
    _, sequences, _ = rollouts
    assert sum(s.images is not None for s in sequences) == 16
    batches = build_micro_batches(
        sequences,
        dp_rank=0,
        dp_size=1,
        micro_batches=2,
        pad_id=0,
        max_tokens_per_micro_batch=256 if packed else None,
    )
    worst, tokens = 0.0, 0
    for batch in batches:
        held = [sequences[i] for i in batch["sequence_index"].tolist()]
        grids = [s.images[IMAGE_GRID_THW] for s in held if s.images is not None]
        assert batch[IMAGE_GRID_THW].tolist() == torch.cat(grids).tolist()  # row order
        mask = batch["loss_mask"].bool()
        diff = (_trainer_logp(trainer_model, batch) - batch["rollout_logp"])[mask]
        worst, tokens = max(worst, float(diff.abs().max())), tokens + int(mask.sum())
    print(f"trainer vs CPU engine logp on images ({'packed' if packed else 'padded'}): max {worst:.2e}")
    assert tokens >= 12
    assert worst <= LOGP_ATOL


def test_a_micro_batch_without_images_has_no_image_keys(rollouts):
    _, sequences, _ = rollouts
    text = [s for s in sequences if s.images is None]
    (batch,) = build_micro_batches(text, dp_rank=0, dp_size=1, micro_batches=1, pad_id=0)
    assert "pixel_values" not in batch and IMAGE_GRID_THW not in batch


def test_patches_that_do_not_fit_the_grids_are_refused(rollouts):
    _, sequences, _ = rollouts
    seq = next(s for s in sequences if s.images is not None)
    bad = dataclasses.replace(seq, images={**seq.images, "pixel_values": seq.images["pixel_values"][:-1]})
    with pytest.raises(ValueError, match=f"{seq.sample_id}: .* image patches for image_grid_thw"):
        build_micro_batches([bad], dp_rank=0, dp_size=1, micro_batches=1, pad_id=0)


def _one_update(model, sequences, lr: float = 0.05) -> None:
    """One plain gradient step on the sequences' log-likelihood (images included)."""
    (batch,) = build_micro_batches(sequences, dp_rank=0, dp_size=1, micro_batches=1, pad_id=0)
    with model_inputs(model, batch) as inputs:
        logits = model(batch["input_ids"], **inputs)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, batch["labels"][..., None]).squeeze(-1)
    (-(logp * batch["loss_mask"]).sum()).backward()
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param -= lr * param.grad
                param.grad = None


@pytest.mark.parametrize("freeze_vision", [False, True], ids=["trained", "frozen"])
def test_weight_sync_after_an_update_carries_the_vision_tower_unless_frozen(
    rollouts, build_trainer_model, freeze_vision
):
    from sapo_megatron.megatron.weights import VISION_HF_PREFIX, iter_hf_buckets

    _, sequences, engine = rollouts
    model = build_trainer_model(freeze_vision=freeze_vision)
    params = dict(engine.model.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    try:
        _one_update(model, sequences)
        after = {
            n: t
            for bucket in iter_hf_buckets(model, model.arch, 1 << 20, include_frozen=True)
            for n, t in bucket
        }
        synced = [(n, t) for bucket in iter_hf_buckets(model, model.arch, 1 << 20) for n, t in bucket]
        engine.update_weights_from_tensors(synced)
        vision = [n for n in params if n.startswith(VISION_HF_PREFIX)]
        assert len(vision) == len(model.arch.vision.tensor_shapes())
        moved = [n for n in vision if not torch.equal(params[n], before[n])]
        if freeze_vision:
            assert moved == [] and all(torch.equal(after[n], before[n]) for n in vision)
        else:
            assert len(moved) >= len(vision) // 2  # the update reached the tower, and the engine got it
            assert all(torch.equal(params[n], after[n]) for n in vision)
        text = "model.language_model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(params[text], before[text]) and torch.equal(params[text], after[text])
    finally:
        engine.update_weights_from_tensors(before.items())  # the module's other tests use the initial weights
