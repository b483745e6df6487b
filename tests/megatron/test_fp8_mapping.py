"""precision.* and model.recompute mapped onto megatron-core's own configs: ``TransformerConfig`` (built and
validated by Megatron, for every recipe), ``DistributedDataParallelConfig`` and the optimizer's ``OptimizerConfig``,
and Megatron's own per-layer decision of which layers stay in bf16. Runs against the installed megatron-core
(0.16.1 here; the same file passes against 0.19.2 with ``PYTHONPATH=$PWD:<unpacked 0.19.2 wheel>``)."""

from __future__ import annotations

# megatron-core 0.19 imports triton at import time unless sapo_megatron's stand-ins are registered first
import sapo_megatron.megatron  # noqa: F401  # isort: skip

import dataclasses
import importlib.util

import megatron.core
import pytest
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.fp8_utils import is_first_last_bf16_layer
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import transformer_config as megatron_tc
from megatron.core.transformer.transformer_config import TransformerConfig

from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.megatron.model import (
    BuildOptions,
    build_gpt_model,
    fp8_ddp_fields,
    fp8_fields,
    fp8_optimizer_fields,
    transformer_config,
)
from sapo_megatron.model.tiny import tiny_hf_config

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
VERSION = megatron.core.__version__


def run_config(kind="dense", layers=4, **sections):
    hf = tiny_hf_config(kind, num_hidden_layers=layers)
    model = {"hf_config": hf, **sections.pop("model", {})}
    return config_from_dict({"model": model, **sections})


def megatron_config(cfg, monkeypatch) -> TransformerConfig:
    # Megatron asks Transformer Engine's version for FP8 MoE layers; there is no TE here: say a recent one.
    monkeypatch.setattr(megatron_tc, "is_te_min_version", lambda *args, **kwargs: True)
    return transformer_config(BuildOptions(cfg.model, cfg.parallel, cfg.precision))


def test_field_names_exist_in_this_megatron_version():
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    for needed in (
        "fp8",
        "fp8_recipe",
        "fp8_amax_history_len",
        "fp8_amax_compute_algo",
        "first_last_layers_bf16",
        "num_layers_at_start_in_bf16",
        "num_layers_at_end_in_bf16",
        "fp8_param",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "recompute_modules",
    ):
        assert needed in names, f"megatron-core {VERSION} has no TransformerConfig.{needed}"
    assert {"fp8_param_gather", "reuse_grad_buf_for_mxfp8_param_ag"} <= {
        f.name for f in dataclasses.fields(DistributedDataParallelConfig)
    }
    assert {"fp8_recipe", "reuse_grad_buf_for_mxfp8_param_ag"} <= {
        f.name for f in dataclasses.fields(OptimizerConfig)
    }


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize(
    ("recipe", "fmt"),
    [("delayed", "hybrid"), ("tensorwise", "hybrid"), ("blockwise", "e4m3"), ("mxfp8", "e4m3")],
)
def test_each_recipe_builds_a_megatron_config(kind, recipe, fmt, monkeypatch):
    cfg = run_config(kind, precision={"dtype": "fp8", "fp8_recipe": recipe})
    config = megatron_config(cfg, monkeypatch)
    assert config.fp8 == fmt and config.fp8_recipe == recipe
    assert config.bf16 and config.params_dtype.is_floating_point and not config.fp8_param
    if recipe == "delayed":  # TE's DelayedScaling defaults, not Megatron's (1, most_recent)
        assert (config.fp8_amax_history_len, config.fp8_amax_compute_algo) == (1024, "max")
    else:  # current / block scaling keep no history: Megatron's defaults stay
        assert (config.fp8_amax_history_len, config.fp8_amax_compute_algo) == (1, "most_recent")
    assert not config.first_last_layers_bf16


def test_delayed_scaling_settings_reach_megatron(monkeypatch):
    cfg = run_config(
        precision={
            "dtype": "fp8",
            "fp8_recipe": "delayed",
            "fp8_amax_history_len": 16,
            "fp8_amax_compute_algo": "most_recent",
        }
    )
    config = megatron_config(cfg, monkeypatch)
    assert (config.fp8_amax_history_len, config.fp8_amax_compute_algo) == (16, "most_recent")


def test_format_override(monkeypatch):
    cfg = run_config(precision={"dtype": "fp8", "fp8_recipe": "tensorwise", "fp8_format": "e4m3"})
    assert megatron_config(cfg, monkeypatch).fp8 == "e4m3"


def test_bf16_edge_layers_are_the_ones_megatron_keeps_in_bf16(monkeypatch):
    cfg = run_config(
        layers=6,
        precision={
            "dtype": "fp8",
            "fp8_recipe": "tensorwise",
            "bf16_layers_at_start": 1,
            "bf16_layers_at_end": 2,
        },
    )
    config = megatron_config(cfg, monkeypatch)
    assert config.first_last_layers_bf16
    assert [is_first_last_bf16_layer(config, layer) for layer in range(6)] == [
        True,
        False,
        False,
        False,
        True,
        True,
    ]
    only_end = megatron_config(
        run_config(layers=6, precision={"dtype": "fp8", "fp8_recipe": "mxfp8", "bf16_layers_at_end": 1}),
        monkeypatch,
    )
    assert [is_first_last_bf16_layer(only_end, layer) for layer in range(6)] == [False] * 5 + [True]


def test_megatron_refuses_what_the_config_refuses_first():
    # Megatron's own rule (delayed + bf16 edge layers) is met earlier, with the field named:
    with pytest.raises(ValueError, match="Delayed scaling does not support first / last layer in BF16"):
        TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, fp8="hybrid", fp8_recipe="delayed",
            first_last_layers_bf16=True,
        )  # fmt: skip
    with pytest.raises(ConfigError, match="cannot keep layers in bf16 under delayed scaling"):
        run_config(precision={"dtype": "fp8", "fp8_recipe": "delayed", "bf16_layers_at_start": 1})


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_fp8_param_gather_reaches_ddp_and_optimizer(recipe, monkeypatch):
    cfg = run_config(
        precision={"dtype": "fp8", "fp8_recipe": recipe, "fp8_param_gather": True},
        optimizer={"use_distributed_optimizer": True},
    )
    assert megatron_config(cfg, monkeypatch).fp8_param
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, **fp8_ddp_fields(cfg.precision))
    assert ddp.fp8_param_gather
    # MXFP8 gathers into the gradient buffer (Megatron warns about the memory otherwise)
    assert ddp.reuse_grad_buf_for_mxfp8_param_ag == (recipe == "mxfp8")
    optimizer = OptimizerConfig(
        bf16=True, use_distributed_optimizer=True, **fp8_optimizer_fields(cfg.precision)
    )
    assert optimizer.fp8_recipe == recipe
    assert optimizer.reuse_grad_buf_for_mxfp8_param_ag == (recipe == "mxfp8")


def test_without_fp8_nothing_fp8_is_set():
    cfg = run_config(precision={"dtype": "bf16"})
    assert (
        fp8_fields(cfg.precision)
        == fp8_ddp_fields(cfg.precision)
        == fp8_optimizer_fields(cfg.precision)
        == {}
    )
    config = transformer_config(BuildOptions(cfg.model, cfg.parallel, cfg.precision))
    assert config.fp8 is None and not config.fp8_param


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({}, (None, None, None, None)),
        ({"recompute": "full"}, ("full", "uniform", 1, None)),
        ({"recompute": "selective"}, ("selective", None, None, ["core_attn"])),
        (
            {"recompute": "selective", "recompute_modules": ["moe", "core_attn"]},
            ("selective", None, None, ["moe", "core_attn"]),
        ),
    ],
)
def test_recompute_maps_onto_megatron(model, expected):
    cfg = run_config("moe", model=model)
    config = transformer_config(BuildOptions(cfg.model, cfg.parallel, cfg.precision))
    got = (config.recompute_granularity, config.recompute_method, config.recompute_num_layers)
    assert got == expected[:3]
    if expected[3] is not None:
        assert config.recompute_modules == expected[3]


@pytest.mark.skipif(HAVE_TE, reason="checks the refusal shown where Transformer Engine is missing")
def test_model_build_refuses_fp8_without_transformer_engine():
    cfg = run_config(precision={"dtype": "fp8"})
    with pytest.raises(ConfigError, match="trains through Transformer Engine, which is not installed here"):
        build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision))
