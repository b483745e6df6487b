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
