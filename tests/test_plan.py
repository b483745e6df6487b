"""The planner: static memory and activations by hand calculation, the memory budget and the fits verdict, the
micro-batch it plans for, ``plan --json``'s shape, ``--world-size`` replacing ``launch.*`` in the dry run, and
the suggested layouts for Qwen3-30B-A3B."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sapo_megatron.cli import main
from sapo_megatron.config import config_from_dict, load_config, validate_layout
from sapo_megatron.model.tiny import tiny_hf_config
from sapo_megatron.plan import (
    PLAN_SCHEMA,
    PlanSettings,
    build_plan,
    memory_estimate,
    stage_shards,
    suggest_layouts,
)
from sapo_megatron.plan.activations import MicroBatchShape, layer_memory, micro_batch_shape, stage_activations
from sapo_megatron.plan.report import GIB

REPO = Path(__file__).resolve().parents[1]
QWEN30B = REPO / "configs/qwen3_30b_a3b_sapo_h100.yaml"


def tiny(kind="moe", model=None, **sections):
    return config_from_dict({"model": {"hf_config": tiny_hf_config(kind), **(model or {})}, **sections})


def test_static_memory_by_hand():
    # tiny MoE: 2 layers, hidden 32, 4 q / 2 kv heads x 8, vocab 64, 8 experts x ffn 16 (untied embeddings)
    cfg = tiny(precision={"dtype": "bf16"}, algorithm={"loss": {"name": "sapo", "kl_coef": 0.1}})
    (shard,) = stage_shards(cfg)
    attention = 32 * (32 + 2 * 16) + 32 * 32 + 2 * 8 + 2 * 32  # qkv, proj, q/k norms, two layer norms
    dense = 2 * (attention + 8 * 32) + 2 * 64 * 32 + 32  # + router per layer; embedding, output, final norm
    experts = 2 * 8 * 3 * 32 * 16
    assert (shard.dense_params, shard.expert_params) == (dense, experts)
    mem = memory_estimate(cfg, shard, world_size=1)
    params = dense + experts
    assert (mem.weights, mem.grads, mem.optimizer) == (2 * params, 4 * params, 12 * params)
    assert mem.reference == 2 * params  # kl_coef > 0: a frozen bf16 copy


def test_fp8_param_gather_keeps_decoder_weights_in_one_byte():
    cfg = tiny(
        precision={"dtype": "fp8", "fp8_param_gather": True}, optimizer={"use_distributed_optimizer": True}
    )
    (shard,) = stage_shards(cfg)
    embedding = 2 * 64 * 32 + 32
    assert memory_estimate(cfg, shard, 1).weights == 2 * embedding + (shard.params - embedding)


def test_te_layer_activations_by_hand():
    # dense tiny layer, bf16, 2 x 16 tokens, TE spec: norm+qkv (x, rsigma, normalised), q/k-norm inputs (the qkv
    # output) + rsigma + attention output, rotated q/k + softmax statistics, norm+fc1, fc1 output, activation
    cfg = tiny("dense", precision={"dtype": "bf16"})
    tokens, h, d = 32, 32, 2
    per_token = (2 * h * d + 4) + ((4 + 4) * 8 * d + 4 * 6 + 4 * 8 * d) + (6 * 8 * d + 4 * 4)
    per_token += (2 * h * d + 4) + 3 * 64 * d
    layer = layer_memory(cfg, MicroBatchShape(2, 16), moe=False, spec="te")
    assert layer.kept == tokens * per_token


def test_sharding_recompute_and_pipeline_rules():
    def kept(cfg, spec="te"):
        return layer_memory(cfg, MicroBatchShape(2, 64), moe=True, spec=spec).kept

    base = tiny(precision={"dtype": "bf16"})
    tp2 = tiny(
        precision={"dtype": "bf16"},
        parallel={"tp": 2, "sequence_parallel": True, "ep": 2, "etp": 1},
        launch={"procs_per_node": 2},
    )
    assert kept(tp2) == pytest.approx(kept(base) / 2)  # TP + SP (and EP over the same ranks) shard everything
    full = tiny(precision={"dtype": "bf16"}, model={"recompute": "full"})
    assert kept(full) == 2 * 64 * 32 * 2  # only the layer input [s, b, h] in bf16
    moe = tiny(precision={"dtype": "bf16"}, model={"recompute": "selective", "recompute_modules": ["moe"]})
    blocks = layer_memory(base, MicroBatchShape(2, 64), moe=True, spec="te").blocks
    assert kept(moe) == pytest.approx(kept(base) - blocks["router"] - blocks["experts"] + 2 * 64 * 32 * 2)
    fp32 = tiny(precision={"dtype": "fp32"})
    assert kept(fp32, spec="te") > kept(base, spec="te")
    pp = config_from_dict(
        {
            "model": {"hf_config": tiny_hf_config("moe", num_hidden_layers=4)},
            "parallel": {"pp": 2, "micro_batches": 4},
            "launch": {"procs_per_node": 2},
        }
    )
    shape = MicroBatchShape(1, 64)
    first, last = (
        stage_activations(pp, shape, s, shard.layers, spec="te") for s, shard in enumerate(stage_shards(pp))
    )
    assert (first.in_flight, last.in_flight) == (2, 1)  # 1F1B: stage k holds pp - k micro-batches


def test_micro_batch_is_the_rank_share_padded_to_the_multiple():
    cfg = load_config(QWEN30B)  # 256 prompts x 8 / 4 mini-batches = 512 sequences; dp 8, 64 micro-batches
    shape = micro_batch_shape(cfg, 32, prompt_tokens=500)
    assert (shape.sequences, shape.seq_len) == (1, 8692)  # 500 + 8192, a multiple of tp 4 already
    fp8 = load_config(QWEN30B, {"precision.dtype": "fp8", "parallel.micro_batches": 16})
    shape = micro_batch_shape(fp8, 32, prompt_tokens=500)
    assert (shape.sequences, shape.seq_len) == (4, 8704)  # 8692 up to a multiple of 4 x 16 = 64


def test_an_episode_pads_the_micro_batch_to_its_context_limit():
    overrides = {"rollout.multi_turn": {"max_context_tokens": 16384}, "data.apply_chat_template": True}
    shape = micro_batch_shape(load_config(QWEN30B, overrides), 32, prompt_tokens=500)
    assert (shape.sequences, shape.seq_len) == (1, 16384)  # not 500 + 8192: turns and observations add up


def test_packing_budget_replaces_the_padded_rectangle():
    cfg = tiny(precision={"dtype": "fp8"}, parallel={"max_tokens_per_micro_batch": 1000})
    shape = micro_batch_shape(cfg, 1, prompt_tokens=64)
    assert (shape.sequences, shape.seq_len, shape.packed) == (1, 1008, True)


def test_budget_and_verdict(capsys):
    cfg = load_config(QWEN30B, {"rollout.colocation": "split", "rollout.weight_sync": "tensor"})
    plan = build_plan(cfg, PlanSettings(world_size=32, gpu_memory_gib=80, rollout_mem_fraction=0.25))
    assert plan.budget == pytest.approx((80 - 2 - 0.05 * 80 - 0.25 * 80) * GIB)  # 54 GiB per rank
    assert build_plan(cfg, PlanSettings(world_size=32)).gpu_memory == 79.1 * GIB  # launch.gpu_type: h100
    stage = plan.stages[0]
    assert stage.total == stage.static.total + stage.activations.total
    assert plan.fits == (stage.total <= plan.budget)
    assert main(["plan", str(QWEN30B)]) == 0
    assert "verdict: fits in memory on every rank" in capsys.readouterr().out
    assert main(["plan", str(QWEN30B), "--gpu-memory-gb", "40"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "--suggest" in out


def test_rollout_fraction_needs_a_colocated_engine(capsys):
    assert main(["plan", str(QWEN30B), "--rollout-mem-fraction", "0.5"]) == 2
    assert "rollout.colocation is none" in capsys.readouterr().err


def test_json_shape(capsys):
    assert main(["plan", str(QWEN30B), "--json", "--world-size", "16", "--suggest", "2"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == PLAN_SCHEMA
    assert set(data) == {
        "schema", "name", "model", "world_size", "layout", "precision", "micro_batch", "spec", "gpu", "stages",
        "peak_gib", "fits", "suggestions",
    }  # fmt: skip
    assert data["world_size"] == 16 and data["layout"]["dp"] == 4
    assert set(data["layout"]) == {
        "tp", "pp", "cp", "dp", "ep", "etp", "sequence_parallel", "micro_batches", "recompute", "recompute_modules",
    }  # fmt: skip
    assert set(data["micro_batch"]) == {"sequences", "seq_len", "tokens", "packed", "length_multiple"}
    assert set(data["gpu"]) == {"memory_gib", "reserved_gib", "rollout_gib", "budget_gib"}
    (stage,) = data["stages"]
    assert set(stage) == {
        "pp_rank",
        "layers",
        "params",
        "expert_params",
        "memory_gib",
        "activations",
        "headroom_gib",
        "fits",
        "phases_gib",
    }
    assert set(stage["memory_gib"]) == {"weights", "grads", "optimizer", "reference", "activations", "total"}
    assert stage["phases_gib"] == {
        "train": stage["memory_gib"]["total"],
        "rollout": None,
        "peak": stage["memory_gib"]["total"],
    }
    assert set(stage["activations"]) == {"in_flight", "per_micro_batch_gib", "transient_gib", "per_layer_gib"}
    assert stage["layers"] == [0, 48] and stage["fits"] == data["fits"]
    assert stage["memory_gib"]["total"] == pytest.approx(
        sum(v for k, v in stage["memory_gib"].items() if k != "total"), abs=0.01
    )
    assert len(data["suggestions"]) == 2 and all(s["fits"] for s in data["suggestions"])


def test_dry_run_uses_the_world_size_given(capsys):
    # launch.* says 3 ranks, for which the demo's batch does not split: --world-size replaces it
    assert main(["train", "--dry-run", "--set", "launch.procs_per_node=3"]) == 2
    assert "each RL update has 128 sequences" in capsys.readouterr().err
    assert main(["train", "--dry-run", "--set", "launch.procs_per_node=3", "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "world size 1 = tp 1" in out and "verdict: fits" in out
    assert main(["train", str(QWEN30B), "--dry-run", "--world-size", "16"]) == 2  # inputs live on the cluster
    assert "world size 16 = tp 4 × pp 1 × cp 1 × dp 4" in capsys.readouterr().out


@pytest.mark.parametrize("world", [8, 16, 32, 64])
def test_suggested_layouts_for_qwen3_30b(world):
    cfg = load_config(QWEN30B, check_layout=False)  # its 64 micro-batches do not split on every world size
    suggestions = suggest_layouts(cfg, PlanSettings(world_size=world, gpu_memory_gib=80), top=5)
    assert suggestions, f"no layout fits on {world} GPUs"
    keys = [s.rank_key for s in suggestions]
    assert keys == sorted(keys)
    for s in suggestions:
        assert s.plan.fits
        validate_layout(s.plan.cfg, world)
        assert s.plan.shape.sequences == 1  # one sequence per micro-batch
    if world >= 16:  # enough GPUs to hold the model without recomputation
        assert suggestions[0].plan.cfg.model.recompute == "none"


def test_suggestions_even_when_the_config_layout_does_not_split(capsys):
    assert main(["plan", str(QWEN30B), "--world-size", "64", "--suggest", "2"]) == 1
    out = capsys.readouterr().out
    assert "the config's layout on 64 GPUs: invalid parallel layout" in out
    assert "layouts that fit on 64 GPUs, best first" in out


def test_time_shared_colocation_fits_where_the_fixed_split_does_not(capsys):
    """rollout.colocation: time_shared time-shares the GPU: peak = max(train phase, rollout phase) against the whole budget, so
    Qwen3-30B-A3B on 16 H100s finds layouts that the fixed 0.5 split rejects."""
    split = {"rollout.colocation": "split", "rollout.weight_sync": "tensor"}
    fixed = load_config(QWEN30B, split)
    shared = load_config(QWEN30B, {**split, "rollout.colocation": {"name": "time_shared", "bucket_mb": 1024}})
    settings = PlanSettings(world_size=32, gpu_memory_gib=80, rollout_mem_fraction=0.5)
    plan_fixed, plan_shared = build_plan(fixed, settings), build_plan(shared, settings)
    stage = plan_shared.stages[0]
    assert plan_shared.budget == pytest.approx(
        (80 - 2 - 0.05 * 80) * GIB
    )  # the engine is released in training
    assert stage.train_phase == plan_fixed.stages[0].total
    assert stage.rollout_phase == pytest.approx(0.5 * 80 * GIB + stage.static.reference + 1024**3)
    assert stage.total == max(stage.train_phase, stage.rollout_phase)
    resident = load_config(
        QWEN30B, {**split, "rollout.colocation": {"name": "time_shared", "offload_trainer": False}}
    )
    kept = build_plan(resident, settings).stages[0]
    static = kept.static
    assert kept.rollout_phase == pytest.approx(
        0.5 * 80 * GIB + static.weights + static.grads + static.optimizer + static.reference + 512 * 1024**2
    )
    overrides = [
        "--set",
        "rollout.colocation=split",
        "--set",
        "rollout.weight_sync=tensor",
        "--world-size",
        "16",
    ]
    assert main(["plan", str(QWEN30B), *overrides, "--suggest", "3"]) == 1
    assert "no layout of this model fits on 16 GPUs" in capsys.readouterr().out
    main(["plan", str(QWEN30B), *overrides, "--set", "rollout.colocation=time_shared", "--suggest", "3"])
    out = capsys.readouterr().out
    assert "layouts that fit on 16 GPUs" in out and "time-shared (rollout.colocation): peak = max(" in out


def test_the_plan_pads_to_no_longer_prompt_than_the_model_context_leaves(capsys):
    """Found re-timing the newcomers' paths: the dry run of the embedded default (context 64) said "32 sequences
    x 520 tokens (prompt 512 + rollout.max_new_tokens 8)". The planned prompt is now capped at the context minus
    max_new_tokens. Fails before this test."""
    from sapo_megatron.plan.activations import planned_prompt_tokens

    cfg = load_config(None)
    assert cfg.model.arch.max_position_embeddings == 64 and cfg.rollout.max_new_tokens == 6
    assert planned_prompt_tokens(cfg, 512) == 58 and planned_prompt_tokens(cfg, 20) == 20
    assert micro_batch_shape(cfg, 1, 512).seq_len == 64
    assert main(["plan"]) == 0
    assert "x 64 tokens (prompt 58 + rollout.max_new_tokens 6" in capsys.readouterr().out


CP32K = Path(__file__).resolve().parents[1] / "configs" / "recipes" / "sapo_qwen3_30b_a3b_32k_cp2.yaml"


def test_suggest_proposes_context_parallelism_for_long_responses():
    """32K-token responses on 16 GPUs: the best layout splits each sequence over 2 CP ranks (it fits without
    recomputation, where every cp 1 layout needs it); 8K-token responses keep cp 1 (no CP candidates)."""
    cfg = load_config(CP32K, check_layout=False)
    settings = PlanSettings(world_size=16, gpu_memory_gib=80)
    every = suggest_layouts(cfg, settings, top=1000)
    assert every[0].plan.cfg.parallel.cp == 2 and every[0].plan.cfg.model.recompute == "none"
    cp1 = [s for s in every if s.plan.cfg.parallel.cp == 1]
    assert cp1 and all(s.plan.cfg.model.recompute != "none" for s in cp1)
    short = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"max_new_tokens": 8192})})
    assert {s.plan.cfg.parallel.cp for s in suggest_layouts(short, settings, top=10)} == {1}


def test_the_32k_cp2_recipe_fits_32_h100s_as_its_comments_say():
    cfg = load_config(CP32K)
    assert (cfg.parallel.cp, cfg.rollout.max_new_tokens) == (2, 32768)
    plan = build_plan(cfg, PlanSettings(world_size=32))
    assert plan.fits
    assert min(s.headroom for s in plan.stages) / GIB == pytest.approx(15.33, abs=0.01)
    without_cp = cfg.model_copy(
        update={"parallel": cfg.parallel.model_copy(update={"cp": 1, "micro_batches": 64})}
    )
    assert not build_plan(without_cp, PlanSettings(world_size=32)).fits
