"""Configuration: loading, validation errors that name the field and the fix, the resolved config, dry run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from sapo_megatron.cli import main
from sapo_megatron.config import ConfigError, config_from_dict, load_config, validate_layout
from sapo_megatron.tiny import tiny_hf_config

REPO = Path(__file__).resolve().parents[1]
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def raw(kind: str = "moe", **sections):
    return {"model": {"hf_config": tiny_hf_config(kind)}, **sections}


def error_of(data) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    return str(info.value)


def test_defaults_validate_and_resolve():
    cfg = config_from_dict(raw())
    assert cfg.parallel.etp == cfg.parallel.tp == 1
    assert cfg.algorithm.loss.name == "sapo"
    assert cfg.algorithm.loss.tau_pos == 1.0 and cfg.algorithm.loss.tau_neg == 1.05
    assert cfg.model.arch.num_experts == 8


def test_etp_defaults_to_tp():
    cfg = config_from_dict(raw(parallel={"tp": 2, "sequence_parallel": True}, launch={"procs_per_node": 2}))
    assert cfg.parallel.etp == 2


def test_tp_must_divide_attention_heads():
    message = error_of(raw(parallel={"tp": 3}, launch={"procs_per_node": 3}))
    assert "parallel.tp=3 does not divide model num_attention_heads=4" in message
    assert "choose tp in [1, 2, 4]" in message


def test_tp_must_divide_kv_heads():
    message = error_of(raw("dense", parallel={"tp": 4}, launch={"procs_per_node": 4}))
    assert "parallel.tp=4 does not divide model num_key_value_heads=2" in message


def test_experts_must_divide_by_ep():
    message = error_of(raw(parallel={"ep": 3}, launch={"procs_per_node": 3}))
    assert "num_experts=8 is not divisible by parallel.ep=3" in message


def test_layers_must_divide_by_pp():
    message = error_of(raw(parallel={"pp": 3}, launch={"procs_per_node": 3}))
    assert "num_hidden_layers=2 is not divisible by parallel.pp=3" in message


def test_moe_with_tp_needs_sequence_parallel():
    message = error_of(raw(parallel={"tp": 2}, launch={"procs_per_node": 2}))
    assert "set parallel.sequence_parallel: true" in message


def test_world_size_must_divide_by_model_parallel_size():
    message = error_of(raw(parallel={"tp": 2, "sequence_parallel": True}, launch={"procs_per_node": 3}))
    assert "world size 3" in message and "not divisible by parallel.tp × parallel.pp × parallel.cp" in message


def test_world_size_checked_again_at_launch():
    cfg = config_from_dict(raw(parallel={"pp": 2}, launch={"procs_per_node": 2}))
    with pytest.raises(ConfigError, match="world size 3"):
        validate_layout(cfg, 3)


def test_etp_below_tp_without_ep_is_refused():
    message = error_of(
        raw(parallel={"tp": 2, "etp": 1, "sequence_parallel": True}, launch={"procs_per_node": 2})
    )
    assert "set etp equal to tp" in message


def test_unknown_key_names_it_and_suggests():
    message = error_of(raw(parallel={"tpp": 2}))
    assert "parallel.tpp: unknown key; did you mean 'tp'?" in message


def test_unknown_top_level_section():
    assert "paralel: unknown key; did you mean 'parallel'?" in error_of({**raw(), "paralel": {}})


def test_wrong_type_names_field():
    message = error_of(raw(parallel={"tp": "two"}))
    assert "parallel.tp:" in message and "'two'" in message


def test_loss_settings_belong_to_their_loss():
    message = error_of(raw(algorithm={"loss": {"name": "sapo", "eps_high": 0.28}}))
    assert "algorithm.loss.sapo.eps_high: unknown key" in message


def test_unknown_loss_name():
    assert "algorithm.loss" in error_of(raw(algorithm={"loss": {"name": "ppo"}}))


@pytest.mark.skipif(HAVE_TE, reason="checks the message shown where Transformer Engine is missing")
def test_fp8_without_transformer_engine():
    message = error_of(raw(precision={"dtype": "fp8"}))
    assert "precision.dtype=fp8 needs Transformer Engine" in message and "use precision.dtype=bf16" in message


def test_context_parallel_is_refused_up_front():
    message = error_of(raw(parallel={"cp": 2}, launch={"procs_per_node": 2}))
    assert "parallel.cp > 1 (context parallelism) is not supported yet" in message


def test_distributed_optimizer_needs_adam():
    message = error_of(raw(optimizer={"name": "sgd", "use_distributed_optimizer": True}))
    assert "use_distributed_optimizer needs optimizer.name=adam" in message


def test_sequence_parallel_needs_tp():
    assert "sequence_parallel needs parallel.tp > 1" in error_of(raw(parallel={"sequence_parallel": True}))


def test_batch_must_split_over_ranks_and_micro_batches():
    message = error_of(raw(parallel={"micro_batches": 3}))
    assert "not divisible by data-parallel size × parallel.micro_batches = 3" in message


def test_unsupported_architecture_is_named():
    bad = tiny_hf_config("dense")
    bad["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    assert "rope scaling type 'yarn' is not supported" in error_of({"model": {"hf_config": bad}})
    assert "model_type='llama' is not supported" in error_of(
        {"model": {"hf_config": {"model_type": "llama"}}}
    )


def test_yaml_relative_hf_config_and_overrides(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(__import__("json").dumps(tiny_hf_config()))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"hf_config": "hf"}, "trainer": {"steps": 3}}))
    cfg = load_config(path, {"trainer.steps": 5, "parallel.micro_batches": 2})
    assert cfg.trainer.steps == 5 and cfg.parallel.micro_batches == 2
    assert cfg.model.arch.hidden_size == 32


def test_bad_yaml_and_missing_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = config_from_dict(raw(trainer={"steps": 7}))
    path = cfg.save_resolved(tmp_path / "config.yaml")
    again = load_config(path)
    assert again.model_dump() == cfg.model_dump() | {"model": again.model_dump()["model"]}
    assert again.model.arch == cfg.model.arch
    assert again.trainer.steps == 7


def test_embedded_default_validates():
    cfg = load_config(None)
    assert cfg.model.arch.is_moe and cfg.rollout.engine == "cpu"


@pytest.mark.parametrize("path", sorted((REPO / "configs").rglob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    validate_layout(cfg, cfg.launch.world_size)


def test_dry_run_prints_layout_for_qwen3_30b(capsys):
    assert main(["train", str(REPO / "configs/qwen3_30b_a3b_sapo_h100.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "total parameters: 30.532 B" in out
    assert "world size 32 = tp 4 × pp 1 × cp 1 × dp 8" in out


def test_cli_reports_config_errors(capsys):
    assert main(["train", "--dry-run", "--set", "parallel.tp=3", "--set", "launch.procs_per_node=3"]) == 2
    assert "parallel.tp=3 does not divide" in capsys.readouterr().err


def test_demo_config_file_equals_embedded_default():
    from_file = load_config(REPO / "configs/demo_tiny_moe_cpu.yaml")
    assert from_file.model_dump() == load_config(None).model_dump()
