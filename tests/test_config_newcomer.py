"""``--set`` of a section validated as YAML is (issue 38, item 4; the TRL user's `--set algorithm.loss.name=sapo`
on a GRPO config)."""

from __future__ import annotations

import logging

import pytest
import yaml

from sapo_megatron.config import ConfigError, load_config
from sapo_megatron.model.tiny import tiny_hf_config


@pytest.fixture
def grpo_config(tmp_path):
    path = tmp_path / "grpo.yaml"
    loss = {"name": "grpo", "eps_low": 0.2, "eps_high": 0.3, "kl_coef": 0.01}
    path.write_text(yaml.safe_dump({"model": {"hf_config": tiny_hf_config()}, "algorithm": {"loss": loss}}))
    return path


def test_a_section_value_with_a_name_is_validated_like_yaml_in_any_order(grpo_config):
    """Fails on 3855bb6: ``{eps_low: 0.2, name: sapo}`` set eps_low, then the switch dropped it without a word;
    in YAML the same section is an error."""
    for value in ({"eps_low": 0.1, "name": "sapo"}, {"name": "sapo", "eps_low": 0.1}):
        with pytest.raises(ConfigError, match=r"algorithm\.loss\.sapo\.eps_low: unknown key"):
            load_config(grpo_config, {"algorithm.loss": value})
    cfg = load_config(grpo_config, {"algorithm.loss": {"tau_pos": 2.0, "name": "sapo"}})
    assert (cfg.algorithm.loss.name, cfg.algorithm.loss.tau_pos, cfg.algorithm.loss.kl_coef) == (
        "sapo",
        2.0,
        0.01,
    )


def test_switching_by_name_names_what_it_drops(grpo_config, caplog):
    """Fails on 3855bb6: the GRPO clip range vanished silently. The switch itself stays (compare's arms use it);
    a key at the old variant's default (eps_low 0.2) loses nothing and is not named."""
    with caplog.at_level(logging.WARNING, logger="sapo_megatron.config"):
        cfg = load_config(grpo_config, {"algorithm.loss.name": "sapo"})
    assert cfg.algorithm.loss.name == "sapo" and cfg.algorithm.loss.kl_coef == 0.01
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("--set algorithm.loss.name=sapo drops eps_high=0.3: settings of grpo")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sapo_megatron.config"):  # no switch: nothing to drop or say
        load_config(grpo_config, {"algorithm.loss.name": "grpo"})
    assert not caplog.records
