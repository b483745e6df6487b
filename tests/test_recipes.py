"""The published-setting recipes (configs/recipes/): the SAPO paper's Qwen3-30B-A3B run and its GSPO and GRPO-R2
siblings load, carry the papers' loss settings, and differ from each other only in what the comparison varies."""

from __future__ import annotations

from pathlib import Path

from sapo_megatron.config import load_config

RECIPES = Path(__file__).resolve().parents[1] / "configs" / "recipes"
VARIED = {"name", "output_dir", "algorithm"}


def test_the_sapo_recipe_and_its_siblings_differ_only_in_the_algorithm():
    configs = {
        arm: load_config(RECIPES / f"{arm}_qwen3_30b_a3b.yaml").model_dump(mode="json")
        for arm in ("sapo", "gspo", "grpo_r2")
    }
    sapo = configs["sapo"]
    for arm, cfg in configs.items():
        differing = {key for key in sapo if sapo[key] != cfg[key]}
        assert differing <= VARIED, (arm, differing - VARIED)
    loss = {arm: cfg["algorithm"]["loss"] for arm, cfg in configs.items()}
    assert (loss["sapo"]["tau_pos"], loss["sapo"]["tau_neg"], loss["sapo"]["agg"]) == (
        1.0,
        1.05,
        "seq-mean-token-mean",
    )
    assert (loss["gspo"]["eps_low"], loss["gspo"]["eps_high"]) == (3e-4, 4e-4)
    assert (loss["grpo_r2"]["eps_low"], loss["grpo_r2"]["eps_high"], loss["grpo_r2"]["agg"]) == (
        0.2,
        0.27,
        "token-mean",
    )
    replay = {arm: cfg["algorithm"]["routing_replay"] for arm, cfg in configs.items()}
    assert replay == {"sapo": "none", "gspo": "none", "grpo_r2": "r2"}
    assert sapo["trainer"]["mini_batches"] == 4
    assert load_config(RECIPES / "sapo_qwen3_30b_a3b.yaml").model.arch.num_experts == 128


def test_the_retool_recipe_carries_slimes_tool_settings():
    cfg = load_config(RECIPES / "retool_qwen3_4b.yaml")
    mt = cfg.rollout.multi_turn
    assert (mt.max_turns, mt.max_tool_calls, mt.max_concurrent_tools) == (16, 16, 32)
    assert (mt.python_tool, mt.python_timeout_s, mt.python_memory_mb) == (True, 120.0, 4096)
    assert mt.tool_timeout_s > mt.python_timeout_s  # the sandbox's wall limit answers first
    assert cfg.data.apply_chat_template
    assert (cfg.rollout.n_samples, cfg.trainer.prompts_per_step, cfg.rollout.temperature) == (8, 32, 0.8)
    loss = cfg.algorithm.loss
    assert (loss.name, loss.eps_low, loss.eps_high) == ("grpo", 0.2, 0.28)
    assert cfg.parallel.max_tokens_per_micro_batch >= mt.max_context_tokens


def test_the_vl_mixed_recipe_loads_with_the_sapo_papers_loss():
    cfg = load_config(RECIPES / "qwen3_vl_30b_a3b_sapo_mixed.yaml")
    loss = cfg.algorithm.loss
    assert (loss.name, loss.tau_pos, loss.tau_neg, loss.agg) == ("sapo", 1.0, 1.05, "seq-mean-token-mean")
    assert (cfg.algorithm.routing_replay, cfg.trainer.mini_batches) == ("none", 4)
    assert cfg.algorithm.reward == "mixed_tasks"
    assert cfg.model.arch.vision is not None  # Qwen3-VL: the vision tower is part of the model
    assert cfg.data.apply_chat_template
    names = [d.name for d in cfg.eval.datasets]
    assert names == ["aime24", "livecodebench", "knights_knaves", "mathvista"]
    assert cfg.eval.datasets[1].n == 8


BASELINES = {
    "cispo": {"name": "cispo", "max_ratio": 5.0, "min_ratio": None, "agg": "token-mean"},
    "gmpo": {"name": "gmpo", "clip_low": 0.4, "clip_high": 0.4, "agg": "seq-mean-token-mean"},
    "dppo_tv": {"name": "dppo_tv", "delta_low": 0.15, "delta_high": 0.15, "ratio_cap": None, "max_len": 8192},
    "dppo_kl": {"name": "dppo_kl", "delta_low": 0.05, "delta_high": 0.05, "ratio_cap": None, "max_len": 8192},
    "m2po": {"name": "m2po", "m2_threshold": 0.04, "agg": "token-mean"},
}


def test_the_baseline_recipes_are_the_sapo_run_with_their_authors_loss():
    sapo = load_config(RECIPES / "sapo_qwen3_30b_a3b.yaml").model_dump(mode="json")
    for arm, expected in BASELINES.items():
        cfg = load_config(RECIPES / f"{arm}_qwen3_30b_a3b.yaml").model_dump(mode="json")
        differing = {key for key in sapo if sapo[key] != cfg[key]}
        assert differing <= VARIED, (arm, differing - VARIED)
        algorithm = cfg["algorithm"]
        assert {key: algorithm["loss"][key] for key in expected} == expected, arm
        assert algorithm["routing_replay"] == "none", arm  # the claims are made without routing replay
        assert algorithm["advantage"]["name"] == ("drgrpo" if arm.startswith("dppo") else "grpo"), arm
        assert cfg["trainer"] == sapo["trainer"] and cfg["rollout"] == sapo["rollout"]


def test_the_fully_async_recipe_is_the_sapo_recipe_run_asynchronously():
    sapo = load_config(RECIPES / "sapo_qwen3_30b_a3b.yaml").model_dump(mode="json")
    cfg = load_config(RECIPES / "sapo_qwen3_30b_a3b_fully_async.yaml")
    dumped = cfg.model_dump(mode="json")
    assert {key for key in sapo if sapo[key] != dumped[key]} == {"name", "output_dir", "algorithm", "trainer"}
    trainer = cfg.trainer
    assert (trainer.rollout_mode, trainer.max_staleness, trainer.stale_groups) == ("fully_async", 2, "drop")
    assert (cfg.algorithm.correction.name, cfg.algorithm.proximal_logp) == ("tis", "recompute")
    assert dumped["algorithm"]["loss"] == sapo["algorithm"]["loss"]
    asynchronous = {
        "rollout_mode",
        "max_staleness",
        "async_chunk_groups",
        "async_inflight_chunks",
    }  # drop: default
    assert (trainer.async_chunk_groups, trainer.async_inflight_chunks) == (64, 4)
    assert {k for k in sapo["trainer"] if sapo["trainer"][k] != dumped["trainer"][k]} == asynchronous
