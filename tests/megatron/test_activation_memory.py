"""The planner's activation formula against a measured CPU forward + backward (Megatron's local spec, bf16): the
bytes autograd keeps for the backward within 2%, the allocator's peak within 25%; and model.recompute changes
what is kept without changing the gradients. One spawned rank runs every case (bench/bench_planner.py runs more,
TP2+SP and EP2 included)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed import run_distributed

KEPT_TOLERANCE = 0.02
PEAK_TOLERANCE = 0.25
CASES = {
    "moe": {"kind": "moe", "model": {}},
    "moe, selective core_attn+moe": {
        "kind": "moe",
        "model": {"recompute": "selective", "recompute_modules": ["core_attn", "moe"]},
    },
    "moe, full": {"kind": "moe", "model": {"recompute": "full"}},
    "dense": {"kind": "dense", "model": {}},
}
BATCH, SEQ, LAYERS = 2, 128, 2


def case_config(kind: str, model: dict[str, Any]):
    from sapo_megatron.config import config_from_dict
    from sapo_megatron.model.tiny import tiny_hf_config

    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64} if kind == "moe" else {}
    hf = tiny_hf_config(
        kind,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        **moe,
    )
    return config_from_dict({"model": {"hf_config": hf, **model}, "precision": {"dtype": "bf16"}})


def measure_cases(payload: dict) -> dict[str, dict[str, float]]:
    """Rank body: every case's measured and planned bytes, and the gradients of the MoE cases."""
    import torch

    from sapo_megatron.megatron.activation_probe import measure_activations
    from sapo_megatron.megatron.model import BuildOptions, build_gpt_model
    from sapo_megatron.megatron.parallel import init_parallel
    from sapo_megatron.plan.activations import MicroBatchShape, stage_activations

    torch.set_num_threads(1)
    out = {}
    for index, (name, case) in enumerate(CASES.items()):
        cfg = case_config(case["kind"], case["model"])
        if index == 0:
            init_parallel(cfg.parallel, seed=0)  # one rank, the same layout for every case
        torch.manual_seed(0)  # the same weights for every case of a kind
        model = build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision))
        ids = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        measured = measure_activations(model, ids, measure_peak=name in payload["peak_cases"])
        est = stage_activations(cfg, MicroBatchShape(BATCH, SEQ), 0, (0, LAYERS), spec="local")
        grads = torch.cat(
            [
                p.main_grad.flatten() if hasattr(p, "main_grad") else p.grad.flatten()
                for p in model.parameters()
            ]
        )
        out[name] = {
            "kept": measured.saved,
            "peak": measured.peak,
            "est_kept": est.per_micro_batch,
            "est_peak": est.per_micro_batch + est.transient,
            "grads": grads.float(),
        }
    return out


@pytest.fixture(scope="module")
def measured():
    return run_distributed(
        "tests.megatron.test_activation_memory:measure_cases", 1, {"peak_cases": ["moe", "moe, full"]}
    )[0]


@pytest.mark.parametrize("name", list(CASES))
def test_kept_activations_match_the_formula(measured, name):
    r = measured[name]
    assert r["est_kept"] == pytest.approx(r["kept"], rel=KEPT_TOLERANCE)


@pytest.mark.parametrize("name", ["moe", "moe, full"])
def test_peak_within_tolerance(measured, name):
    r = measured[name]
    assert r["est_peak"] == pytest.approx(r["peak"], rel=PEAK_TOLERANCE)
    assert r["peak"] > r["kept"]  # the backward's working memory comes on top


def test_recompute_keeps_less_and_gives_the_same_gradients(measured):
    plain, selective, full = measured["moe"], measured["moe, selective core_attn+moe"], measured["moe, full"]
    assert full["kept"] < selective["kept"] < plain["kept"]
    assert full["kept"] < 0.15 * plain["kept"]  # one hidden state per layer instead of every block's tensors
    for other in (selective, full):
        assert (other["grads"] - plain["grads"]).abs().max().item() == 0.0  # bf16, same ops recomputed: exact
