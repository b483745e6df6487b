"""The planner on a vision-language model: the real Qwen3-VL-30B-A3B config counts transformers' parameters, the
vision tower sits on the first stage, a frozen tower has no gradients or optimizer state, an image budget adds
activations, and ``--suggest`` finds layouts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from sapo_megatron.cli import main
from sapo_megatron.config import load_config
from sapo_megatron.model.arch import QwenArch
from sapo_megatron.plan import PlanSettings, build_plan, memory_estimate, stage_shards, suggest_layouts
from sapo_megatron.plan.activations import vision_bytes

REPO = Path(__file__).resolve().parents[1]
QWEN30B = REPO / "configs/qwen3_30b_a3b_sapo_h100.yaml"
VL_CONFIG = REPO / "configs/hf/qwen3_vl_30b_a3b.json"
VL = ["--set", "model.hf_config=hf/qwen3_vl_30b_a3b.json"]


def vl_config(**model):
    overrides = {"model.hf_config": str(VL_CONFIG), **{f"model.{k}": v for k, v in model.items()}}
    return load_config(QWEN30B, overrides=overrides, check_layout=False)


def test_real_config_counts_transformers_parameters():
    raw = json.loads(VL_CONFIG.read_text())
    with torch.device("meta"):
        model = transformers.Qwen3VLMoeForConditionalGeneration(transformers.AutoConfig.for_model(**raw))
    expected = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.model.visual.parameters())
    arch = QwenArch.from_hf_dict(raw)
    assert arch.num_parameters() == expected == 31_070_754_032
    assert arch.vision.num_parameters() == vision == 538_631_408
    cfg = vl_config()
    one_rank = cfg.model_copy(
        update={"parallel": cfg.parallel.model_copy(update={"tp": 1, "pp": 1, "ep": 1, "etp": 1})}
    )
    assert sum(s.params for s in stage_shards(one_rank)) == expected


def test_vision_tower_on_the_first_stage_and_frozen_without_state():
    cfg = vl_config()
    stages = stage_shards(cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"pp": 2})}))
    vision = cfg.model.arch.vision.num_parameters()
    assert [s.vision_params for s in stages] == [vision, 0]
    trained, frozen = stage_shards(cfg)[0], stage_shards(vl_config(freeze_vision=True))[0]
    assert frozen.params == trained.params and frozen.frozen_params == vision
    world = 16
    mem, mem_frozen = (
        memory_estimate(cfg, trained, world),
        memory_estimate(vl_config(freeze_vision=True), frozen, world),
    )
    assert mem.weights == mem_frozen.weights
    assert mem.grads - mem_frozen.grads == 4 * vision
    assert mem_frozen.optimizer < mem.optimizer


def test_image_budget_adds_vision_activations_to_the_first_stage_only():
    cfg = vl_config()
    cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"pp": 2})})
    text = build_plan(cfg, PlanSettings(world_size=16, gpu_memory_gib=80))
    images = build_plan(cfg, PlanSettings(world_size=16, gpu_memory_gib=80, image_patches=4096))
    added = vision_bytes(cfg, 4096)
    # bf16, per patch: 27 blocks of (10·1152 + 2·4304) + 4 mergers (final + 3 DeepStack) of 3·1152
    assert added == 4096 * (27 * (10 * 1152 + 2 * 4304) + 4 * 3 * 1152) * 2
    first, last = images.stages[0].activations, text.stages[0].activations
    assert first.per_micro_batch - last.per_micro_batch == added
    assert images.stages[1].activations == text.stages[1].activations
    assert vision_bytes(vl_config(freeze_vision=True), 4096) == 0


def test_plan_command_and_suggestions_for_the_vl_model(capsys):
    assert main(["plan", str(QWEN30B), *VL, "--world-size", "16", "--image-patches", "4096"]) in (0, 1)
    out = capsys.readouterr().out
    assert (
        "model: qwen3_vl_moe, 48 layers" in out
        and "total parameters: 31.071 B (vision tower 538.631 M on stage 0" in out
    )
    suggestions = suggest_layouts(
        vl_config(), PlanSettings(world_size=16, gpu_memory_gib=80, image_patches=4096)
    )
    assert suggestions and all(s.plan.fits for s in suggestions)
    assert main(["plan", str(QWEN30B), "--world-size", "16", "--image-patches", "8"]) == 2
    assert "has no vision tower" in capsys.readouterr().err
