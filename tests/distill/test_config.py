"""The teachers section and algorithm.fusion are checked when the config is loaded (before any process group),
with errors that name the field and the fix."""

from __future__ import annotations

import pytest

from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.data.prompts import PromptRow
from sapo_megatron.distill.config import DistillConfigError, check_domains_served, default_teacher
from sapo_megatron.model.tiny import tiny_hf_config

TEACHER = {"name": "t", "model_path": "teacher/hf"}


def load(**sections):
    return config_from_dict({"model": {"hf_config": tiny_hf_config("dense")}, **sections})


def test_saf_defaults_are_the_authors_selected_hyperparameters():
    """kissshhot/SAF-OPD's full SAF: TOPK_PERCENT=20 TANH_COEF=0.1 OPD_WARMUP_STEPS=100 KL_DROP_DELTA=0.2
    OPD_ANNEAL=True (ANNEAL_STEPS=200, ANNEAL_MIN=0.0, ANNEAL_TOTAL_STEPS=0), GRPO_COEF=OPD_COEF=1.0."""
    fusion = load(teachers=[TEACHER], algorithm={"fusion": {"mode": "saf"}}).algorithm.fusion
    assert (fusion.grpo_coef, fusion.opd_coef, fusion.sparsify.keep, fusion.compress.c) == (
        1.0,
        1.0,
        0.2,
        0.1,
    )
    assert (fusion.warmup.steps, fusion.warmup.kl_drop) == (100, 0.2)
    assert (fusion.anneal.steps, fusion.anneal.floor, fusion.anneal.total_steps) == (200, 0.0, None)
    no_stop = {"mode": "saf", "warmup": {"kl_drop": 0.0}, "anneal": {"total_steps": 300}}
    schedule = load(teachers=[TEACHER], algorithm={"fusion": no_stop}).algorithm.fusion.build_schedule()
    assert schedule.state_dict()["settings"]["kl_drop"] == 0.0
    assert schedule.state_dict()["settings"]["anneal_total_steps"] == 300


def test_opd_with_sequence_level_gspo_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"sequence-level ratio needs one advantage per sequence"):
        load(teachers=[TEACHER], algorithm={"loss": {"name": "gspo"}, "fusion": {"mode": "opd"}})
    cfg = load(teachers=[TEACHER], algorithm={"loss": {"name": "gspo_token"}, "fusion": {"mode": "saf"}})
    assert cfg.algorithm.fusion.mode == "saf"
    load(teachers=[TEACHER], algorithm={"loss": {"name": "gspo"}})  # rl mode: sequence advantages, allowed


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"algorithm": {"fusion": {"mode": "fixed"}}},
            r"distils from a teacher, and the config has no teachers",
        ),
        (
            {"teachers": [TEACHER], "algorithm": {"fusion": {"mode": "mopd"}, "correction": {"name": "tis"}}},
            r"would weight the tokens a second time",
        ),
        ({"teachers": [{"name": "t"}]}, r"engine cpu needs model_path"),
        ({"teachers": [{"name": "t", "engine": "sglang"}]}, r"engine sglang needs urls"),
        (
            {"teachers": [{"name": "t", "engine": "sglang", "urls": ["http://h:1"], "model_path": "x"}]},
            r"model_path is for engine cpu / cpu_http",
        ),
        ({"teachers": [TEACHER, TEACHER]}, r"names \['t'\] are used twice"),
        (
            {"teachers": [{**TEACHER, "domains": ["a"]}, {**TEACHER, "name": "u", "domains": ["a"]}]},
            r"domain 'a' is listed by 't' and 'u'",
        ),
        (
            {"teachers": [{**TEACHER, "default": True}, {**TEACHER, "name": "u", "default": True}]},
            r"are all marked default",
        ),
        ({"teachers": [{**TEACHER, "name": "a/b"}]}, r"teachers.0.name"),
        (
            {"algorithm": {"fusion": {"mode": "saf", "sparsify": {"keep": 0}}}, "teachers": [TEACHER]},
            r"algorithm.fusion.saf.sparsify.keep",
        ),
        (
            {
                "teachers": [TEACHER],
                "algorithm": {"fusion": {"mode": "opd"}, "opd_student_logp": "engine"},
                "rollout": {"temperature": 0.7},
            },
            r"opd_student_logp='engine'.*rollout.temperature=0.7.*teachers score at temperature 1",
        ),
    ],
)
def test_bad_distillation_settings_are_refused(sections, message):
    with pytest.raises(ConfigError, match=message):
        load(**sections)


def test_every_prompt_needs_a_teacher():
    add = load(teachers=[{**TEACHER, "domains": ["addition"]}]).teachers
    rows = [PromptRow("1+1=", "2", "addition"), PromptRow("2*2=", "4", "multiplication")]
    with pytest.raises(
        DistillConfigError, match=r"synthetic row 1: no teacher serves its domain 'multiplication'"
    ):
        check_domains_served(add, rows, "synthetic")
    only = load(teachers=[TEACHER]).teachers  # one teacher without domains serves everything
    assert default_teacher(only).name == "t"
    check_domains_served(only, rows, "synthetic")
