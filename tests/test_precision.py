"""FP8 in the config: every recipe validates, dry-runs and plans without Transformer Engine, training refuses it
with a clear message; the padding multiple rule; the GPU-capability refusals (mxfp8 on Hopper); the settings that
only apply to some recipes; the recompute settings."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from sapo_megatron.cli import main
from sapo_megatron.config import ConfigError, config_from_dict, sequence_length_multiple
from sapo_megatron.model import precision as precision_mod
from sapo_megatron.model.batching import TrainSequence
from sapo_megatron.model.precision import FP8_RECIPES, fp8_capability_problem, fp8_runtime_problem
from sapo_megatron.model.tiny import tiny_hf_config

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
RECIPES = list(FP8_RECIPES)


def cfg_of(kind="moe", *, precision=None, parallel=None, launch=None, optimizer=None, model=None, **sections):
    data = {"model": {"hf_config": tiny_hf_config(kind), **(model or {})}, **sections}
    for name, value in (("precision", precision), ("parallel", parallel), ("launch", launch)):
        if value is not None:
            data[name] = value
    if optimizer is not None:
        data["optimizer"] = optimizer
    return config_from_dict(data)


def error_of(**kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        cfg_of(**kwargs)
    return str(info.value)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_validates_without_transformer_engine(recipe):
    cfg = cfg_of(precision={"dtype": "fp8", "fp8_recipe": recipe})
    assert cfg.precision.fp8_recipe == recipe
    expected_format = {"delayed": "hybrid", "tensorwise": "hybrid", "blockwise": "e4m3", "mxfp8": "e4m3"}
    assert cfg.precision.fp8_format_resolved == expected_format[recipe]


@pytest.mark.parametrize(
    ("parallel", "fp8", "multiple"),
    [
        ({}, None, 1),
        ({"tp": 2, "sequence_parallel": True}, None, 2),
        ({}, "tensorwise", 16),
        ({}, "delayed", 16),
        ({}, "blockwise", 16),
        ({}, "mxfp8", 32),
        ({"tp": 2, "sequence_parallel": True}, "tensorwise", 32),  # each TP rank's shard of the tokens: 16
        ({"tp": 2, "sequence_parallel": True}, "mxfp8", 64),
    ],
)
def test_sequence_length_multiple_combines_fp8_and_sequence_parallel(parallel, fp8, multiple):
    precision = {"dtype": "fp8", "fp8_recipe": fp8} if fp8 else {"dtype": "bf16"}
    cfg = cfg_of(
        "dense", precision=precision, parallel=parallel, launch={"procs_per_node": parallel.get("tp", 1)}
    )
    assert sequence_length_multiple(cfg) == multiple


def test_dense_tp_without_sequence_parallel_pads_only_for_fp8():
    cfg = cfg_of("dense", precision={"dtype": "fp8"}, parallel={"tp": 2}, launch={"procs_per_node": 2})
    assert sequence_length_multiple(cfg) == 16


def test_trainer_pads_micro_batches_to_the_multiple():
    from sapo_megatron.loop.trainer import _micro_batches

    cfg = cfg_of(precision={"dtype": "fp8", "fp8_recipe": "mxfp8"})
    session = SimpleNamespace(
        cfg=cfg, info=SimpleNamespace(dp_rank=0, dp_size=1), tokenizer=SimpleNamespace(pad_id=0)
    )
    sequences = [TrainSequence([1, 2, 3], [4] * n, advantage=1.0) for n in (5, 9)]
    (micro,) = _micro_batches(session, sequences)
    assert micro["input_ids"].shape == (2, 32)  # 3 + 9 tokens, padded to MXFP8's 32


@pytest.mark.parametrize("recipe", RECIPES)
def test_dry_run_and_plan_work_without_transformer_engine(recipe, capsys):
    args = ["--set", "precision.dtype=fp8", "--set", f"precision.fp8_recipe={recipe}"]
    assert main(["train", "--dry-run", *args]) == 0
    out = capsys.readouterr().out
    assert f"precision fp8 (recipe {recipe}" in out and "inputs OK" in out
    assert main(["plan", *args]) == 0
    assert "fits in memory on every rank" in capsys.readouterr().out


@pytest.mark.skipif(HAVE_TE, reason="checks the refusal shown where Transformer Engine is missing")
def test_training_refuses_fp8_without_transformer_engine_before_starting(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert main(["train", "--output-dir", str(out_dir), "--set", "precision.dtype=fp8"]) == 2
    err = capsys.readouterr().err
    assert "precision.dtype=fp8 trains through Transformer Engine, which is not installed here" in err
    assert "hint: `sapo-megatron plan CONFIG` and `train --dry-run` work without it" in err
    assert not out_dir.exists()  # refused before the run directory, the model or any rank


def test_runtime_check_names_the_gpu_it_finds(monkeypatch):
    import torch

    monkeypatch.setattr(precision_mod, "have_transformer_engine", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    problem = fp8_runtime_problem("mxfp8")
    assert "needs Blackwell" in problem and "NVIDIA H100 80GB HBM3 has 9.0" in problem
    assert fp8_runtime_problem("tensorwise") is None and fp8_runtime_problem("blockwise") is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert fp8_runtime_problem("mxfp8") is None


def test_mxfp8_refused_for_hopper_when_the_gpu_type_is_known():
    message = error_of(precision={"dtype": "fp8", "fp8_recipe": "mxfp8"}, launch={"gpu_type": "h100"})
    assert (
        "precision.fp8_recipe=mxfp8 needs Blackwell" in message and "launch.gpu_type=h100 has 9.0" in message
    )
    assert "use fp8_recipe tensorwise or blockwise" in message
    for gpu in ("b200", "gb300"):
        cfg_of(precision={"dtype": "fp8", "fp8_recipe": "mxfp8"}, launch={"gpu_type": gpu})
    cfg_of(precision={"dtype": "fp8", "fp8_recipe": "blockwise"}, launch={"gpu_type": "h200"})
    cfg_of(precision={"dtype": "bf16"}, launch={"gpu_type": "a100"})  # bf16 runs anywhere


def test_capability_rules_follow_transformer_engine():
    assert "needs compute capability 8.9+" in fp8_capability_problem("tensorwise", (8, 0), "A100")
    assert fp8_capability_problem("delayed", (8, 9), "L40S") is None
    assert "needs compute capability 9.0+" in fp8_capability_problem("blockwise", (8, 9), "L40S")
    assert "does not run it on compute capability 12.0" in fp8_capability_problem("mxfp8", (12, 0), "RTX")
    message = error_of(precision={"dtype": "fp8"}, launch={"gpu_type": "a100"})
    assert "fp8_recipe=tensorwise needs compute capability 8.9+; launch.gpu_type=a100 has 8.0" in message


def test_delayed_scaling_settings_only_with_delayed():
    cfg = cfg_of(precision={"dtype": "fp8", "fp8_recipe": "delayed", "fp8_amax_history_len": 16})
    assert cfg.precision.fp8_amax_history_len == 16
    message = error_of(precision={"dtype": "fp8", "fp8_recipe": "tensorwise", "fp8_amax_history_len": 16})
    assert "precision.fp8_amax_history_len is a delayed-scaling setting" in message


def test_bf16_edge_layers_not_with_delayed_and_at_most_a_stage():
    message = error_of(precision={"dtype": "fp8", "fp8_recipe": "delayed", "bf16_layers_at_start": 1})
    assert "cannot keep layers in bf16 under delayed scaling" in message
    message = error_of(precision={"dtype": "fp8", "bf16_layers_at_end": 3})  # the tiny model has 2 layers
    assert "precision.bf16_layers_at_end=3 exceeds the 2 decoder layers of a pipeline stage" in message


def test_fp8_settings_refused_without_fp8():
    message = error_of(precision={"dtype": "bf16", "fp8_param_gather": True})
    assert "precision.fp8_param_gather only applies to precision.dtype=fp8 (dtype is bf16)" in message


def test_fp8_param_gather_needs_the_distributed_optimizer():
    message = error_of(precision={"dtype": "fp8", "fp8_param_gather": True})
    assert "set optimizer.use_distributed_optimizer: true" in message
    cfg = cfg_of(
        precision={"dtype": "fp8", "fp8_param_gather": True}, optimizer={"use_distributed_optimizer": True}
    )
    assert cfg.precision.fp8_param_gather


def test_recompute_settings_are_checked():
    assert cfg_of(model={"recompute": "selective"}).model.selective_modules == ["core_attn"]
    message = error_of(model={"recompute": "full", "recompute_modules": ["moe"]})
    assert "model.recompute_modules only applies to model.recompute=selective" in message
    message = error_of(model={"recompute": "selective", "recompute_modules": ["moe_act"]})
    assert "moe_act needs model.moe_grouped_gemm: true" in message
    message = error_of(kind="dense", model={"recompute": "selective", "recompute_modules": ["moe"]})
    assert "moe has nothing to recompute in this model (no MoE layers)" in message
    message = error_of(model={"recompute": "selective", "recompute_modules": ["mlp"]})
    assert "mlp has nothing to recompute in this model (no dense MLP layers)" in message
