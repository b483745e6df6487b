"""Configuration: loading, validation errors that name the field and the fix, the resolved config, dry run."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from sapo_megatron.cli import main
from sapo_megatron.config import (
    ConfigError,
    config_from_dict,
    load_config,
    sequence_length_multiple,
    validate_layout,
)
from sapo_megatron.model.tiny import tiny_hf_config

REPO = Path(__file__).resolve().parents[1]


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
    assert message.splitlines()[1] == (
        "  - algorithm.loss.sapo.eps_high: unknown key; accepted keys: agg, entropy_coef, kl_coef, level, max_len, "
        "name, tau_neg, tau_pos; 'eps_high' is a setting of algorithm.loss grpo / gspo / gspo_token, not sapo: "
        "to switch, --set algorithm.loss.name=grpo"
    )


@pytest.mark.parametrize(
    ("sections", "line"),
    [
        (
            {"parallel": {"tpp": 2}},
            "parallel.tpp: unknown key; did you mean 'tp'? Accepted keys: cp, ep, etp, ",
        ),
        (
            {"algorithm": {"advantage": {"std": 1}}},
            "algorithm.advantage.std: unknown key; accepted keys: eps, name",
        ),
        (
            {"algorithm": {"correction": {"name": "tis", "cap_": 3}}},
            "algorithm.correction.tis.cap_: unknown key; did you mean 'cap'? Accepted keys: cap, name",
        ),
        (
            {"algorithm": {"loss": {"name": "gspo", "tau_pos": 1}}},
            "algorithm.loss.gspo.tau_pos: unknown key; accepted keys: agg, entropy_coef, eps_high, eps_low, "
            "kl_coef, max_len, name; 'tau_pos' is a setting of algorithm.loss sapo, not gspo: to switch, "
            "--set algorithm.loss.name=sapo",
        ),
        (
            {"algorithm": {"reward_fn": "x"}},
            "algorithm.reward_fn: unknown key; did you mean 'reward'? Accepted keys: ",
        ),
    ],
    ids=["parallel", "advantage", "correction", "loss", "algorithm"],
)
def test_every_unknown_key_error_lists_the_accepted_keys(sections, line):
    assert f"  - {line}" in error_of(raw(**sections))


def test_unknown_or_missing_variant_name_lists_the_variants():
    message = error_of(raw(algorithm={"loss": {"name": "ppo"}}))
    assert (
        "algorithm.loss: unknown name 'ppo'; choose one of: sapo (agg, max_len, kl_coef, entropy_coef, "
        in message
    )
    assert "grpo (agg, max_len, kl_coef, entropy_coef, eps_low, eps_high, dual_clip)" in message
    message = error_of(raw(algorithm={"correction": {"cap": 3}}))
    assert message.splitlines()[1] == (
        "  - algorithm.correction: no 'name' given; choose one of: none (no settings); tis (cap); icepop (low, high); "
        "rollout_corr (is_level, is_threshold, is_batch_normalize, reject). Example: --set 'algorithm.correction={name: none}'"
    )
    assert "algorithm.loss: expected a mapping with a 'name', got 'grpo'" in error_of(
        raw(algorithm={"loss": "grpo"})
    )


def test_setting_a_loss_name_switches_the_loss_and_keeps_shared_settings(tmp_path):
    path = tmp_path / "run.yaml"
    loss = {"name": "sapo", "tau_pos": 2.0, "tau_neg": 3.0, "kl_coef": 0.05, "agg": "token-mean"}
    path.write_text(yaml.safe_dump({"model": {"hf_config": tiny_hf_config()}, "algorithm": {"loss": loss}}))
    cfg = load_config(path, {"algorithm.loss.name": "grpo", "algorithm.correction.name": "tis"})
    assert cfg.algorithm.loss.model_dump() == {
        "name": "grpo",
        "agg": "token-mean",  # shared settings stay
        "kl_coef": 0.05,
        "entropy_coef": 0.0,
        "max_len": None,
        "eps_low": 0.2,  # grpo's own defaults; sapo's tau_pos / tau_neg are gone
        "eps_high": 0.28,
        "dual_clip": None,
    }
    assert cfg.algorithm.correction.name == "tis" and cfg.algorithm.correction.cap == 2.0
    cfg = load_config(path, {"algorithm.loss.name": "gspo", "algorithm.loss.eps_high": 5e-4})
    assert (cfg.algorithm.loss.name, cfg.algorithm.loss.eps_high) == ("gspo", 5e-4)
    assert load_config(path, {"name": "x"}).algorithm.loss.tau_pos == 2.0  # a run's name is no variant


def test_cli_switches_the_loss_of_the_demo(capsys):
    assert main(["train", "--dry-run", "--set", "algorithm.loss.name=grpo"]) == 0
    assert "layout OK" in capsys.readouterr().out


def test_context_parallel_pads_to_its_chunks():
    cfg = config_from_dict(raw(parallel={"cp": 2}, launch={"procs_per_node": 2}))
    assert cfg.parallel.model_parallel_size == 2 and sequence_length_multiple(cfg) == 4
    tp_sp = config_from_dict(
        raw(parallel={"cp": 2, "tp": 2, "sequence_parallel": True}, launch={"procs_per_node": 4})
    )
    assert sequence_length_multiple(tp_sp) == 8  # 2·cp chunks, each CP rank's split over the TP ranks
    vl = config_from_dict(raw("vl_moe", parallel={"cp": 2}, launch={"procs_per_node": 2}))
    assert sequence_length_multiple(vl) == 4


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
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(__import__("json").dumps(tiny_hf_config()))
    settings = {
        "trainer": {"steps": 7, "prompts_per_step": 4},
        "parallel": {"micro_batches": 2},
        "algorithm": {"loss": {"name": "grpo", "eps_high": 0.3}, "correction": {"name": "tis", "cap": 3.0}},
        "rollout": {"temperature": 0.5, "n_samples": 4},
        "data": {"train": "train.jsonl", "digits": 3},
    }
    cfg = config_from_dict({"model": {"hf_config": str(tmp_path / "hf")}, **settings})
    saved = cfg.save_resolved(tmp_path / "out" / "config.yaml")
    again = load_config(saved)
    assert again.model_dump(exclude={"model"}) == cfg.model_dump(exclude={"model"})
    assert again.model.hf_config == tiny_hf_config_resolved(cfg)  # the architecture is inlined
    assert again.model.model_dump(exclude={"hf_config"}) == cfg.model.model_dump(exclude={"hf_config"})
    assert again.model.arch == cfg.model.arch
    assert (again.trainer.steps, again.algorithm.loss.eps_high, again.algorithm.correction.cap) == (
        7,
        0.3,
        3.0,
    )
    assert again.model_dump() != config_from_dict(raw()).model_dump()  # the settings above are no defaults


def tiny_hf_config_resolved(cfg) -> dict:
    """The HF config as save_resolved writes it (a path in ``cfg`` becomes this mapping)."""
    assert isinstance(cfg.model.hf_config, str)
    return cfg.model.arch.to_hf_dict()


def test_embedded_default_validates():
    cfg = load_config(None)
    assert cfg.model.arch.is_moe and cfg.rollout.engine == "cpu"


@pytest.mark.parametrize("path", sorted((REPO / "configs").rglob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    """Every shipped config loads, fits its layout and uses no deprecated key (a user copies what ships)."""
    from sapo_megatron.config.deprecated import DeprecatedConfigKey

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedConfigKey)
        cfg = load_config(path)
    validate_layout(cfg, cfg.launch.world_size)


def test_dry_run_prints_layout_for_qwen3_30b_then_names_the_missing_inputs(capsys):
    # the data, tokenizer and checkpoint live on the cluster: the layout is checked here, the files are not
    assert main(["train", str(REPO / "configs/qwen3_30b_a3b_sapo_h100.yaml"), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert "total parameters: 30.532 B" in captured.out
    assert "world size 32 = tp 4 × pp 1 × cp 1 × dp 8" in captured.out
    assert "data.train" in captured.err and "/data/dapo-math-17k.jsonl" in captured.err
    assert "hint: the layout above is valid" in captured.err


def test_dry_run_with_every_input_present_is_ok(capsys):
    assert main(["train", "--dry-run"]) == 0  # the embedded demo: synthetic data, char tokenizer
    assert "inputs OK" in capsys.readouterr().out


def test_cli_reports_config_errors(capsys):
    assert main(["train", "--dry-run", "--set", "parallel.tp=3", "--set", "launch.procs_per_node=3"]) == 2
    assert "parallel.tp=3 does not divide" in capsys.readouterr().err


def test_demo_config_file_equals_embedded_default():
    from_file = load_config(REPO / "configs/demo_tiny_moe_cpu.yaml")
    assert from_file.model_dump() == load_config(None).model_dump()
