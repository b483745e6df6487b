"""Keys of the previous release (``rollout.cpu_http``, ``rollout.colocated``, ``rollout.colocate``,
``teachers[].cpu_http``): each still loads as its new form, with one warning line that names the new key; an old
key that contradicts its new form is refused."""

from __future__ import annotations

import json
import warnings

import pytest

from sapo_megatron.config import ConfigError, DeprecatedConfigKey, config_from_dict, load_config
from sapo_megatron.model.tiny import tiny_hf_config

SGLANG = {"engine": "sglang", "urls": ["http://w:30000"], "weight_sync": "tensor"}


def load(rollout: dict, **sections) -> tuple[object, list[str]]:
    """The config of ``rollout`` and the deprecation lines it printed."""
    raw = {"model": {"hf_config": tiny_hf_config("moe")}, "rollout": rollout, **sections}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config_from_dict(raw, source="old.yaml")
    lines = [
        warnings.formatwarning(w.message, w.category, w.filename, w.lineno, None).strip()
        for w in caught
        if issubclass(w.category, DeprecatedConfigKey)
    ]
    return cfg, lines


def new_form(rollout: dict, **sections):
    cfg, lines = load(rollout, **sections)
    assert lines == []
    return cfg


@pytest.mark.parametrize(
    ("old", "new", "line"),
    [
        (
            {"cpu_http": True},
            {"engine": "cpu_http"},
            "rollout.cpu_http: true is deprecated: use rollout.engine: cpu_http",
        ),
        (
            {"engine": "cpu", "cpu_http": True},
            {"engine": "cpu_http"},
            "rollout.cpu_http: true is deprecated: use rollout.engine: cpu_http",
        ),
        (
            {"cpu_http": False},
            {"engine": "cpu"},
            "rollout.cpu_http: false is deprecated: use rollout.engine (cpu, cpu_http or sglang)",
        ),
        (
            {**SGLANG, "colocated": True},
            {**SGLANG, "colocation": "split"},
            "rollout.colocated: true is deprecated: use rollout.colocation: split",
        ),
        (
            {"colocated": False},
            {"colocation": "none"},
            "rollout.colocated: false is deprecated: use rollout.colocation: none (the default)",
        ),
        (
            {"colocate": None},
            {"colocation": "none"},
            "rollout.colocate: null is deprecated: use rollout.colocation: none (the default)",
        ),
        (
            {**SGLANG, "colocated": True, "colocate": {"bucket_mb": 64, "check_weights": True}},
            {**SGLANG, "colocation": {"name": "time_shared", "bucket_mb": 64, "check_weights": True}},
            "rollout.colocate is deprecated: use rollout.colocation: {name: time_shared, bucket_mb: ..., "
            "check_weights: ...}",
        ),
    ],
)
def test_an_old_rollout_key_loads_as_its_new_form_with_one_line_naming_it(old, new, line):
    cfg, lines = load(old)
    assert cfg.rollout == new_form(new).rollout
    assert lines == [f"old.yaml:0: DeprecatedConfigKey: {line} (the old key is read until the next release)"]


def test_cpu_http_with_colocate_maps_both_keys():
    cfg, lines = load({"cpu_http": True, "colocate": {"offload_trainer": False}})
    assert cfg.rollout.engine == "cpu_http" and cfg.rollout.time_shared is not None
    assert cfg.rollout.time_shared.offload_trainer is False and cfg.rollout.time_shared.bucket_mb == 512
    assert [line.split(" is deprecated")[0] for line in lines] == [
        "old.yaml:0: DeprecatedConfigKey: rollout.cpu_http: true",
        "old.yaml:0: DeprecatedConfigKey: rollout.colocate",
    ]


def test_a_teachers_cpu_http_loads_as_its_engine():
    teacher = {"name": "t", "model_path": "teacher_hf", "default": True}
    fusion = {"algorithm": {"fusion": {"mode": "opd"}}}
    cfg, lines = load({}, teachers=[{**teacher, "cpu_http": True}], **fusion)
    assert cfg.teachers == new_form({}, teachers=[{**teacher, "engine": "cpu_http"}], **fusion).teachers
    assert lines == [
        "old.yaml:0: DeprecatedConfigKey: teachers[t].cpu_http: true is deprecated: use teachers[t].engine: "
        "cpu_http (the old key is read until the next release)"
    ]


def test_old_keys_work_as_overrides_and_warn_naming_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"model": {"hf_config": tiny_hf_config("moe")}}))  # JSON is YAML
    with pytest.warns(DeprecatedConfigKey) as got:
        cfg = load_config(path, {"rollout.cpu_http": True, "rollout.colocate.bucket_mb": 8})
    assert cfg.rollout.engine == "cpu_http" and cfg.rollout.time_shared.bucket_mb == 8
    assert [str(w.message).split(" is deprecated: use ")[1].split(" (")[0] for w in got] == [
        "rollout.engine: cpu_http",
        "rollout.colocation: {name: time_shared, bucket_mb: ...}",
    ]
    assert {w.filename for w in got} == {str(path)}


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        (
            {**SGLANG, "cpu_http": True},
            "rollout.cpu_http: true contradicts rollout.engine: sglang; the CPU engine behind its HTTP server is "
            "now rollout.engine: cpu_http (drop cpu_http)",
        ),
        (
            {"engine": "cpu_http", "colocate": {}, "colocation": "time_shared"},
            "rollout.colocate and rollout.colocation are the old and the new form of one setting: keep "
            "rollout.colocation only",
        ),
        (
            {"colocate": True},
            "rollout.colocate=True: expected a mapping; it is now rollout.colocation: time_shared",
        ),
    ],
)
def test_an_old_key_that_contradicts_its_new_form_is_refused(rollout, message):
    with pytest.raises(ConfigError) as info:
        load(rollout)
    assert str(info.value) == message


def test_a_resolved_config_of_the_previous_release_loads_as_the_default():
    """What ``save_resolved`` wrote before (``compare`` and ``eval`` read a run's ``config.yaml`` back)."""
    written = {"engine": "cpu", "colocated": False, "cpu_http": False, "colocate": None}
    cfg, lines = load(written)
    assert cfg.rollout == new_form({}).rollout and cfg.rollout.colocation.name == "none"
    assert len(lines) == 2 and all("is deprecated: use rollout." in line for line in lines)
