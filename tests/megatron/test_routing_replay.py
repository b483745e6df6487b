"""MoE routing replay on Megatron's RouterReplay: R2 reproduces the recorded routing and R3 the engine's, in the
forward and in the backward's recomputation, in every parallel layout; the router keeps the gradient of the
replayed gates; bad input and unsupported setups are refused; no replay state outlives a pass.

The routing a router used is observed by a hook on its output (``routing_map``), independently of RouterReplay
(tests/megatron/replay_scenarios.py). Run under megatron-core 0.19 too: ``PYTHONPATH=$PWD:/tmp/mc19/unpacked``.
"""

from __future__ import annotations

import pickle

import pytest

from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.model.tiny import make_tiny_hf_checkpoint, tiny_hf_config
from tests.distributed import run_distributed

MICRO_BATCHES = 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "moe": str(make_tiny_hf_checkpoint(root / "moe", "moe", seed=3)),
        "moe_pre_softmax": str(make_tiny_hf_checkpoint(root / "pre", "moe", seed=3, norm_topk_prob=False)),
        "dense": str(make_tiny_hf_checkpoint(root / "dense", "dense", seed=3)),
    }


@pytest.fixture(scope="module")
def fp8_sequences(checkpoints, tmp_path_factory) -> str:
    """8 samples of the fp8 CPU rollout engine (SGLang's block-wise W8A8 numerics) serving the "moe" checkpoint,
    with its routes, pickled for the ranks: a real engine whose routing differs from the trainer's."""
    from sapo_megatron.model.batching import TrainSequence
    from sapo_megatron.rollout.cpu.engine import CPUEngine
    from sapo_megatron.rollout.types import GenerationRequest, SamplingParams

    engine = CPUEngine.from_pretrained(checkpoints["moe"], seed=3, num_threads=1, precision="fp8")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    prompts = [[3, 17, 5, 9, 30, 12], [40, 2, 8, 8, 51], [21, 22, 23, 24, 25], [7, 1, 44, 19]]
    requests = [
        GenerationRequest(prompt_ids=p, n=2, sampling=sampling, return_routed_experts=True, group_id=i)
        for i, p in enumerate(prompts)
    ]
    sequences = [
        TrainSequence(
            s.prompt_ids, s.response_ids, 1.0, s.rollout_logp, s.routed_experts, f"group {g} sample {i}"
        )
        for g, group in enumerate(engine.generate(requests))
        for i, s in enumerate(group)
    ]
    engine.close()
    path = tmp_path_factory.mktemp("fp8") / "sequences.pkl"
    path.write_bytes(pickle.dumps(sequences))
    return str(path)


# Recomputation: MoE-layer recomputation (``recompute_modules: [moe]``). Full-layer recomputation takes the same
# REPLAY_BACKWARD path, but Megatron's recomputed attention allocates on "cuda" outside the CPU compatibility
# layer's reach (the backward runs inside its torch-function handler), so it is not run here.
LAYOUTS = [
    (1, {"micro_batches": MICRO_BATCHES}, False),
    (1, {"micro_batches": MICRO_BATCHES}, True),
    (2, {"tp": 2, "sequence_parallel": True, "micro_batches": MICRO_BATCHES}, True),
    (2, {"ep": 2, "micro_batches": MICRO_BATCHES}, True),
    (2, {"pp": 2, "micro_batches": MICRO_BATCHES}, True),
    (4, {"tp": 2, "ep": 2, "sequence_parallel": True, "micro_batches": MICRO_BATCHES}, True),
]


@pytest.mark.parametrize(
    ("world", "parallel", "recompute"),
    LAYOUTS,
    ids=["single", "single-recompute", "tp2-sp", "ep2", "pp2", "tp2xep2"],
)
def test_replay_uses_the_given_routes_in_every_layout(checkpoints, fp8_sequences, world, parallel, recompute):
    payload = {
        "hf_dir": checkpoints["moe"],
        "world": world,
        "parallel": parallel,
        "sequences": 8,
        "recompute": recompute,
        "perturb": 0.05,
        "fp8_sequences": fp8_sequences,
    }
    results = run_distributed("tests.megatron.replay_scenarios:replay_layouts", world, payload)
    assert sorted({layer for r in results for layer in r["layers"]}) == [0, 1]  # every MoE layer somewhere
    calls = 2 if recompute else 1  # forward (+ recomputation in the backward)
    for r in results:
        layers = r["layers"]
        assert r["recompute_layers"] == (len(layers) if recompute else 0)
        # the record pass: recorded_routes are exactly what each router chose, this stage's layers only
        assert r["record"]["calls_per_micro_batch"] == {layer: [1] * MICRO_BATCHES for layer in layers}
        assert r["record"]["worst_row_agreement"] == 1.0
        assert r["recorded_other_layers"] == ([-1] if parallel.get("pp", 1) > 1 else [])
        assert not r["leak_after_record"]
        # the perturbed model routes differently from the recorded routes and from the engine's
        assert r["live_vs_recorded"] < 0.6
        assert r["live_vs_engine"] < 0.2
        # R3's old-log-prob pass replays the engine's routes in a forward-only pass
        forward = r["r3_forward_only"]
        assert forward["calls_per_micro_batch"] == {layer: [1] * MICRO_BATCHES for layer in layers}
        assert forward["worst_row_agreement"] == 1.0 and not forward["leak"]
        assert forward["logp_change"] is None or forward["logp_change"] > 1e-3  # None: not the last stage
        # R2 then R3: each step used its own routes, for every token and layer, forward and recomputation
        for arm in ("r2", "r3"):
            step = r[arm]
            assert step["calls_per_micro_batch"] == {layer: [calls] * MICRO_BATCHES for layer in layers}
            assert step["worst_row_agreement"] == 1.0
            assert step["agreement_used"] == (1.0, [1.0, 1.0])
            assert not step["leak"]
        overall, per_layer = r["r3"]["agreement_engine_live"]
        assert overall < 0.2 and all(value < 0.3 for value in per_layer)
        # no replay: the live routing, recorded in the training forward, was used in forward and recomputation
        assert r["live_step"]["calls_per_micro_batch"] == {layer: [calls] * MICRO_BATCHES for layer in layers}
        assert r["live_step"]["worst_row_agreement"] == 1.0
        assert not r["live_step"]["leak"]
        # the fp8 engine's real routes: the trainer's live routing at the same weights differs from them on some
        # token-layers; R3 replays them for every token and layer, forward and recomputation
        live_overall, live_per_layer = r["fp8_live_vs_engine"]
        assert 0.5 < live_overall < 1.0 and min(live_per_layer[:2]) < 1.0
        fp8 = r["fp8_r3"]
        assert fp8["calls_per_micro_batch"] == {layer: [calls] * MICRO_BATCHES for layer in layers}
        assert fp8["worst_row_agreement"] == 1.0 and not fp8["leak"]
        assert fp8["agreement_used"] == (1.0, [1.0, 1.0])
    # agreement metrics are reduced over ranks: identical everywhere
    assert len({repr(r["r3"]["agreement_engine_live"]) for r in results}) == 1


@pytest.mark.parametrize("kind", ["moe", "moe_pre_softmax"])
def test_router_gradient_under_replay_is_the_softmax_over_replayed_experts(checkpoints, kind):
    """Gate = softmax of the live logits over the replayed experts (pre-softmax: the full softmax gathered
    there); dL/dW from Megatron's backward equals the hand formula, and differs from live routing's."""
    payload = {"hf_dir": checkpoints[kind], "world": 1, "parallel": {}}
    (per_layer,) = run_distributed("tests.megatron.replay_scenarios:router_gradient", 1, payload)
    assert sorted(per_layer) == [0, 1]
    for layer in per_layer.values():
        assert layer["live_overlap"] < 0.2  # random routes: mostly not the live top-k
        assert layer["probs_err"] < 1e-6
        assert layer["grad_scale"] > 1e-5
        assert layer["grad_err"] < 1e-6 * layer["grad_scale"] + 1e-12
        assert layer["live_formula_err"] > 0.1 * layer["grad_scale"]


def test_refusals_and_no_state_after_a_failed_step(checkpoints):
    payload = {"hf_dir": checkpoints["moe"], "dense_dir": checkpoints["dense"], "world": 1, "parallel": {}}
    (out,) = run_distributed("tests.megatron.replay_scenarios:refusals", 1, payload)
    assert "no MoE layers" in out["dense"]
    assert "routing_replay=True" in out["record_without_replay"]
    assert "routing_replay=True" in out["replay_without_replay"]
    assert "'recorded_routes'" in out["missing_key"] and "micro-batch 0" in out["missing_key"]
    assert "engine_routes has shape" in out["wrong_shape"]
    assert "no route (-1)" in out["hole"]
    assert "without used_routes" in out["agreement_missing_key"]
    assert "exclude each other" in out["record_and_replay"]
    assert out["weights_unchanged"]
    assert out["failed_step"] == "loss failed" and not out["leak_after_failure"]
    assert "moe_router_fusion" in out["moe_router_fusion"]
    assert "virtual pipeline" in out["virtual_pipeline_model_parallel_size"]
    assert "multi-token prediction" in out["mtp_num_layers"]


def test_config_refuses_r3_without_engine_routes_and_replay_without_moe():
    def error_of(raw) -> str:
        with pytest.raises(ConfigError) as info:
            config_from_dict(raw)
        return str(info.value)

    moe = {"model": {"hf_config": tiny_hf_config("moe")}}
    assert "rollout.routed_experts: true" in error_of({**moe, "algorithm": {"routing_replay": "r3"}})
    dense = {"model": {"hf_config": tiny_hf_config("dense")}, "algorithm": {"routing_replay": "r2"}}
    assert "needs an MoE model" in error_of(dense)
    ok = config_from_dict({**moe, "algorithm": {"routing_replay": "r3"}, "rollout": {"routed_experts": True}})
    assert ok.algorithm.routing_replay == "r3"
    assert config_from_dict({**moe, "algorithm": {"routing_replay": "r2"}}).algorithm.routing_replay == "r2"


def test_routing_agreement_compares_top_k_sets_over_masked_token_layers():
    import torch

    from sapo_megatron.megatron.routing import routing_agreement_by_layer

    a = torch.tensor([[[[0, 1], [2, 3], [-1, -1]], [[4, 5], [6, 7], [-1, -1]], [[0, 1], [0, 1], [-1, -1]]]])
    b = a.clone()
    b[0, 0, 0] = torch.tensor([1, 0])  # same set, other order: agrees
    b[0, 1, 1] = torch.tensor([6, 5])  # differs
    b[0, 2] = torch.tensor([[2, 3], [2, 3], [-1, -1]])  # differs, but position 2 is masked out
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    overall, per_layer = routing_agreement_by_layer(a, b, mask)
    assert overall == pytest.approx(3 / 4)
    assert per_layer[:2] == [1.0, 0.5]
    assert per_layer[2] != per_layer[2]  # NaN: the dense layer has no routes


def test_cpu_engine_routes_line_up_with_the_trainer_and_replay_exactly(checkpoints):
    """The rollout engine's real routes (row t = token at position t) land on the trainer's position t: with the
    same weights they agree with the trainer's live routing (shifted by one they do not); once the trainer's
    routers drift, live agreement drops and R3 replay still uses the engine's routes everywhere."""
    payload = {"hf_dir": checkpoints["moe"], "world": 1, "parallel": {}, "perturb": 0.05}
    (out,) = run_distributed("tests.megatron.replay_scenarios:engine_routes_end_to_end", 1, payload)
    assert out["tokens"] > 40
    assert out["aligned"] >= 0.99
    assert out["shifted_by_one"] < 0.5
    assert out["perturbed_live"] < 0.8
    assert out["replayed"]["worst_row_agreement"] == 1.0
    assert out["replayed"]["calls_per_micro_batch"] == {0: [1, 1], 1: [1, 1]}
    assert out["used"] == (1.0, [1.0, 1.0])
