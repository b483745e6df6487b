"""Arm planning (no training): names and order, each arm's config, identical data and seeds across arms, the
shared warm start, and bad input refused with a message naming it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from sapo_megatron.compare import (
    CORRECTIONS,
    LOSSES,
    REPLAYS,
    Arm,
    CompareError,
    build_plan,
    parse_configurations,
    parse_names,
    plan_arms,
)
from sapo_megatron.config import ConfigError
from sapo_megatron.defaults import embedded_default_dict

SMALL = {"sft.steps": 20, "sft.global_batch": 16, "trainer.prompts_per_step": 4, "rollout.n_samples": 4}
ARM_KEYS = ("name", "output_dir", "seed")
ARM_ALGORITHM_KEYS = ("loss", "correction", "routing_replay")


def plan(tmp_path: Path, config: str | None = None, overrides=SMALL, **kwargs):
    request = {
        "losses": ["sapo", "gspo", "grpo"],
        "replays": ["none", "r2", "r3"],
        "corrections": ["none", "tis"],
        "seeds": 2,
        "steps": 5,
        "output_dir": tmp_path / "cmp",
        **kwargs,
    }
    return build_plan(config, overrides, **request)


def shared_part(cfg) -> dict:
    """A run config without what an arm sets for itself."""
    data = cfg.model_dump(mode="json")
    for key in ARM_KEYS:
        data.pop(key)
    for key in ARM_ALGORITHM_KEYS:
        data["algorithm"].pop(key)
    return data


def test_arms_are_every_combination_seed_major_with_stable_names():
    arms = plan_arms(["sapo", "grpo"], ["none", "r2"], ["none", "tis"], seeds=2)
    assert len(arms) == 16
    assert [arm.name for arm in arms[:5]] == [
        "sapo-none-none-s0",
        "sapo-none-tis-s0",
        "sapo-r2-none-s0",
        "sapo-r2-tis-s0",
        "grpo-none-none-s0",
    ]
    assert {arm.seed for arm in arms[:8]} == {0} and {arm.seed for arm in arms[8:]} == {1}
    assert len({arm.name for arm in arms}) == 16


def test_every_arm_gets_its_loss_correction_replay_and_seed(tmp_path):
    result = plan(tmp_path)
    assert len(result.arms) == 3 * 3 * 2 * 2
    for run in result.arms:
        arm, cfg = run.arm, run.cfg
        loss = cfg.algorithm.loss.model_dump()
        assert {key: loss[key] for key in LOSSES[arm.loss]} == LOSSES[arm.loss], arm.name
        assert cfg.algorithm.correction.model_dump() == CORRECTIONS[arm.correction]
        assert cfg.algorithm.routing_replay == arm.replay
        assert cfg.seed == arm.seed
        assert cfg.trainer.steps == 5
        assert run.run_dir == tmp_path / "cmp" / arm.name == Path(cfg.output_dir)
        assert cfg.name == arm.name
    sapo = result.arms[0].cfg.algorithm.loss
    assert (sapo.name, sapo.tau_pos, sapo.tau_neg) == ("sapo", 1.0, 1.05)
    grpo = next(r.cfg for r in result.arms if r.arm.loss == "grpo").algorithm.loss
    assert (grpo.eps_low, grpo.eps_high, grpo.agg) == (0.2, 0.28, "token-mean")
    gspo = next(r.cfg for r in result.arms if r.arm.loss == "gspo").algorithm.loss
    assert (gspo.name, gspo.eps_low, gspo.eps_high) == ("gspo", 3e-4, 4e-4)


def test_arms_share_everything_else_data_and_seeds_included(tmp_path):
    result = plan(tmp_path)
    shared = [shared_part(run.cfg) for run in result.arms]
    assert all(part == shared[0] for part in shared)
    # the same seed index means the same seed (data order, sampling, held-out set) in every arm
    by_seed = {}
    for run in result.arms:
        by_seed.setdefault(run.arm.seed, set()).add(run.cfg.seed)
    assert by_seed == {0: {0}, 1: {1}}
    data = result.arms[0].cfg.data
    assert (data.train, data.train_size) == ("synthetic:addition", 4000)


def test_arms_start_from_the_shared_warm_start(tmp_path):
    result = plan(tmp_path)
    warm = result.warm_start
    assert warm is not None and warm.run_dir == tmp_path / "cmp" / "warm_start"
    assert (warm.cfg.trainer.steps, warm.cfg.trainer.export_hf, warm.cfg.sft.steps) == (0, True, 20)
    assert warm.cfg.seed == 1234 and warm.cfg.model.init == "random"  # the demo's own seed and init
    for run in result.arms:
        model = run.cfg.model
        assert (model.init, model.init_path) == ("hf", str(tmp_path / "cmp" / "warm_start" / "hf"))
        assert run.cfg.sft.steps == 0
        assert run.cfg.rollout.routed_experts  # MoE demo: every arm logs the live routing agreement


def test_the_demo_has_an_fp8_rollout_that_a_set_can_change(tmp_path):
    assert plan(tmp_path).arms[0].cfg.rollout.precision == "fp8"
    changed = plan(tmp_path, overrides={**SMALL, "rollout.precision": "bf16"})
    assert {run.cfg.rollout.precision for run in changed.arms} == {"bf16"}


def test_a_config_without_sft_has_no_warm_start_and_keeps_its_precision(tmp_path):
    raw = embedded_default_dict()
    raw["sft"]["steps"] = 0
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    result = plan(
        tmp_path, str(config), overrides={}, losses=["sapo"], replays=["none"], corrections=["none"], seeds=1
    )
    assert result.warm_start is None
    (run,) = result.arms
    assert (run.cfg.model.init, run.cfg.sft.steps, run.cfg.rollout.precision) == ("random", 0, "fp32")
    assert result.source == str(config)


def test_shared_loss_settings_reach_every_arm(tmp_path):
    result = plan(tmp_path, overrides={**SMALL, "algorithm.loss.kl_coef": 0.01})
    assert {run.cfg.algorithm.loss.kl_coef for run in result.arms} == {0.01}
    grpo = next(r.cfg for r in result.arms if r.arm.loss == "grpo").algorithm.loss
    assert not hasattr(grpo, "tau_pos")  # the base config's SAPO settings did not leak into GRPO


def test_a_dense_model_takes_no_replay(tmp_path):
    dense = {**SMALL, "model.hf_config.model_type": "qwen3", "model.hf_config.num_experts": 0}
    with pytest.raises(CompareError, match=r"--replay r2,r3: routing replay needs a MoE model"):
        plan(tmp_path, overrides=dense)
    result = plan(tmp_path, overrides=dense, replays=["none"])
    assert not any(run.cfg.rollout.routed_experts for run in result.arms)


@pytest.mark.parametrize(
    ("key", "value", "names"),
    [
        ("seed", 3, "seed index i uses seed i"),
        ("output_dir", "x", "--output-dir"),
        ("trainer.steps", 3, "use --steps"),
        ("algorithm.routing_replay", "r2", "use --replay"),
        ("algorithm.correction.name", "tis", "use --corrections"),
        ("algorithm.correction", {"name": "tis"}, "use --corrections"),
        ("algorithm.loss.tau_neg", 1.2, "paper settings (--losses)"),
        ("algorithm.loss", {"name": "grpo"}, "paper settings (--losses)"),
    ],
)
def test_a_set_of_what_the_arms_set_is_refused(tmp_path, key, value, names):
    with pytest.raises(CompareError, match=rf"^--set {key}: .*{re.escape(names)}"):
        plan(tmp_path, overrides={**SMALL, key: value})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected comma-separated names"),
        ("sapo,", "expected comma-separated names"),
        ("spao", "unknown name 'spao' (did you mean 'sapo'?); choose from sapo, gspo, grpo"),
        ("sapo,grpo,sapo", "sapo given more than once"),
    ],
)
def test_bad_names_are_refused(text, message):
    with pytest.raises(CompareError, match=re.escape(message)):
        parse_names(text, list(LOSSES), "--losses")


def test_names_parse_in_order():
    assert parse_names(" grpo, sapo ", list(LOSSES), "--losses") == ["grpo", "sapo"]
    assert parse_names("r3,none", list(REPLAYS), "--replay") == ["r3", "none"]
    assert tuple(REPLAYS) == ("none", "r2", "r3")


def test_bad_counts_and_layouts_are_refused(tmp_path):
    with pytest.raises(CompareError, match=r"--steps 0: each arm needs at least one RL step"):
        plan(tmp_path, steps=0)
    with pytest.raises(CompareError, match=r"--seeds 0"):
        plan(tmp_path, seeds=0)
    with pytest.raises(CompareError, match=r"launch.nodes=2: compare runs its arms one after another"):
        plan(tmp_path, overrides={**SMALL, "launch.nodes": 2, "launch.procs_per_node": 1})
    with pytest.raises(ConfigError, match=r"unknown key"):  # the config itself is validated as for train
        plan(tmp_path, overrides={**SMALL, "trainer.stepz": 1})


def test_arm_overrides_switch_the_loss_variant_first():
    overrides = Arm("grpo", "r3", "tis", 2).overrides()
    assert next(iter(overrides)) == "algorithm.loss.name"
    assert overrides["algorithm.correction"] == {"name": "tis", "cap": 2.0}
    assert (overrides["algorithm.routing_replay"], overrides["seed"]) == ("r3", 2)


# ------------------------------------------------------------------------------ config arms (--arms, --teachers)

DISTILL = Path(__file__).resolve().parents[2] / "configs" / "distill"


def test_config_arms_run_their_own_configs_and_read_the_teachers_compare_trains(tmp_path):
    from sapo_megatron.compare import build_config_plan

    arms = [str(DISTILL / f"{name}.yaml") for name in ("rl", "saf")]
    plan = build_config_plan(
        arms,
        {},
        teacher_configs=[str(DISTILL / "teacher_addition.yaml")],
        seeds=2,
        steps=5,
        output_dir=tmp_path,
    )
    assert [run.name for run in plan.arms] == ["rl-s0", "saf-s0", "rl-s1", "saf-s1"]
    (teacher,) = plan.teachers
    assert teacher.run_dir == tmp_path / "teachers" / "addition" and teacher.cfg.sft.steps == 1500
    assert plan.warm_start is not None and plan.warm_start.cfg.sft.steps == 400
    # The warm start reads the trained teacher too (its config lists it): any --output-dir works.
    assert plan.warm_start.cfg.teachers[0].model_path == str(tmp_path / "teachers" / "addition" / "hf")
    for run in plan.arms:
        cfg = run.cfg
        assert cfg.seed == run.arm.seed and cfg.trainer.steps == 5 and cfg.sft.steps == 0
        assert cfg.teachers[0].model_path == str(tmp_path / "teachers" / "addition" / "hf")
        assert cfg.model.init_path == str(tmp_path / "warm_start" / "hf")
    assert [run.cfg.algorithm.fusion.mode for run in plan.arms[:2]] == ["rl", "saf"]
    assert plan.arms[0].arm.colour_key != plan.arms[1].arm.colour_key


def test_config_arms_must_share_model_sft_and_data(tmp_path):
    from sapo_megatron.compare import build_config_plan

    arms = [str(DISTILL / "rl.yaml"), str(DISTILL / "mopd.yaml")]
    with pytest.raises(CompareError, match=r"mopd.yaml has another sft section than .*rl.yaml"):
        build_config_plan(arms, {}, seeds=1, steps=5, output_dir=tmp_path)
    bad = tmp_path / "Fixed-Fusion.yaml"
    bad.write_text((DISTILL / "fixed.yaml").read_text())
    with pytest.raises(CompareError, match=r"must be lower-case letters"):
        build_config_plan([str(bad)], {}, seeds=1, steps=5, output_dir=tmp_path)


def test_every_baseline_and_verl_correction_is_an_arm(tmp_path):
    from sapo_megatron.compare.arms import ARM_NAME

    result = plan(tmp_path, losses=list(LOSSES), replays=["none"], corrections=list(CORRECTIONS), seeds=1)
    assert len(result.arms) == len(LOSSES) * len(CORRECTIONS) == 8 * 6
    for run in result.arms:
        arm, cfg = run.arm, run.cfg
        loss = cfg.algorithm.loss.model_dump()
        assert {key: loss[key] for key in LOSSES[arm.loss]} == LOSSES[arm.loss], arm.name
        assert cfg.algorithm.correction.model_dump() == CORRECTIONS[arm.correction], arm.name
        parsed = ARM_NAME.match(arm.name)  # a rerun recognises the directory (dppo_tv-none-geo_rs-s0)
        assert parsed and (parsed["loss"], parsed["correction"]) == (arm.loss, arm.correction)


def test_configurations_choose_arms_instead_of_the_product(tmp_path):
    """``--configurations``: exactly the listed (loss, replay, correction) arms, seed-major in the order given, each
    with the same config as the product's arm of that name."""
    chosen = parse_configurations("dppo_tv-none-none,sapo-r2-none,grpo-none-geo_rs")
    assert chosen == [("dppo_tv", "none", "none"), ("sapo", "r2", "none"), ("grpo", "none", "geo_rs")]
    result = plan(tmp_path, configurations=chosen)
    names = [run.name for run in result.arms]
    assert names == [f"{'-'.join(c)}-s{seed}" for seed in (0, 1) for c in chosen]
    product = {
        run.name: run.cfg
        for run in plan(
            tmp_path,
            losses=["dppo_tv", "sapo", "grpo"],
            replays=["none", "r2"],
            corrections=["none", "geo_rs"],
        ).arms
    }
    for run in result.arms:
        assert run.cfg.model_dump() == product[run.name].model_dump(), run.name


@pytest.mark.parametrize(
    ("text", "given", "message"),
    [
        ("sapo-none", (), "--configurations 'sapo-none': expected LOSS-REPLAY-CORRECTION"),
        (
            "sapo-r4-none",
            (),
            "--configurations 'sapo-r4-none': replay: unknown name 'r4'; choose from none, r2, r3",
        ),
        ("sapo-none-none,sapo-none-none", (), "--configurations: sapo-none-none given more than once"),
        (
            "sapo-none-none",
            ("--losses",),
            "--configurations names every arm's loss, replay and correction; drop --losses",
        ),
    ],
)
def test_bad_configurations_are_refused(text, given, message):
    with pytest.raises(CompareError) as err:
        parse_configurations(text, given)
    assert str(err.value).startswith(message), str(err.value)
