"""The policy loss hook inside Megatron training steps on tiny Qwen3-MoE: the same loss, metrics and updated
weights (SGD lr 1, so weights compare gradients) in a single process, under TP2+SP, PP2, DP2 and CP2, and for 1 vs
4 micro-batches and under CP2 in every aggregation mode; at ratio 1 SAPO's step equals the plain policy-gradient step; and
vocab-parallel log-probs / entropy / gradients under TP2 equal the single-process ones.

Two spawns in all (1 and 2 processes), each running many cases."""

from __future__ import annotations

import pytest
import torch

from sapo_megatron.model.tiny import build_hf_model, make_tiny_hf_checkpoint, tiny_hf_config
from tests.distributed import run_distributed
from tests.loss.test_logprobs import naive

LOSS_RTOL = 1e-5
METRIC_RTOL, METRIC_ATOL = 1e-5, 1e-6
WEIGHT_ATOL = 1e-6
SEED = 3

SAPO = {"name": "sapo", "entropy_coef": 0.01, "kl_coef": 0.01}  # every gradient path: pg, entropy, KL
TIS = {"name": "tis", "cap": 2.0}
AGG_LOSSES = {
    "sapo-seq-mean-token-mean": {"name": "sapo"},
    "sapo-token-mean": {"name": "sapo", "agg": "token-mean"},
    "sapo-seq-mean-token-sum-norm": {"name": "sapo", "agg": "seq-mean-token-sum-norm", "max_len": 32},
    "grpo-token-mean": {"name": "grpo", "agg": "token-mean"},
    "gspo": {"name": "gspo", "eps_low": 0.02, "eps_high": 0.03},
}
TP_VARIANTS = {
    "fp32": {"dtype": torch.float32, "temperature": 1.0, "chunk_tokens": 7},
    "bf16": {"dtype": torch.bfloat16, "temperature": 1.0, "chunk_tokens": 64},
    "fp32-T0.7": {"dtype": torch.float32, "temperature": 0.7, "chunk_tokens": 1024},
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "moe", "moe", seed=SEED))


@pytest.fixture(scope="module")
def data():
    """8 sequences × 33 tokens: prompts (masked), responses of varied length, right padding (NaN in the
    log-prob inputs), a row without response tokens, advantages of both signs; old_logp is the model's own
    log-prob (HF forward) perturbed by N(0, 0.3²), so ratios spread over ~[0.5, 2] and GRPO clips some."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 64, (8, 33), generator=gen)
    prompt = torch.tensor([4, 6, 3, 8, 5, 7, 4, 32])
    end = torch.tensor([32, 20, 27, 32, 12, 25, 30, 32])  # label positions [prompt, end) are the response
    positions = torch.arange(32)
    mask = (positions >= prompt[:, None]) & (positions < end[:, None])
    for row, stop in enumerate(end.tolist()):
        ids[row, stop + 1 :] = 0  # padding token
    model = build_hf_model(tiny_hf_config("moe"), seed=SEED)
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    logp, _ = naive(logits, ids[:, 1:])
    old = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    rollout = old + 0.1 * torch.randn(logp.shape, generator=gen)
    ref = logp + 0.2 * torch.randn(logp.shape, generator=gen)
    for t in (old, rollout, ref):
        t[~mask] = float("nan")
    adv = torch.tensor([1.2, -0.8, 0.5, -1.1, 0.9, 0.7, -0.3, 0.0])
    return {
        "ids": ids,
        "loss_mask": mask.long(),
        "advantages": adv,
        "old_logp": old,
        "rollout_logp": rollout,
        "ref_logp": ref,
        "hf_logp": logp,
    }


def _sapo_case(parallel, **extra):
    return {"parallel": parallel, "loss": SAPO, "correction": TIS, **extra}


def _spawn(hf_dir, data, world, cases):
    step_data = {k: v for k, v in data.items() if k != "hf_logp"}
    payload = {"hf_dir": hf_dir, "world": world, "data": step_data, "cases": cases}
    results = run_distributed("tests.loss.scenarios:run_cases", world, payload, timeout=600)
    return [[rank[i] for rank in results] for i in range(len(cases))]  # per case, per rank


@pytest.fixture(scope="module")
def single(hf_dir, data):
    cases = {
        "ref": _sapo_case({"micro_batches": 1}),
        "mb4": _sapo_case({"micro_batches": 4}),
        "bf16": _sapo_case({"micro_batches": 2}, precision={"dtype": "bf16"}),
        "sapo-r1": {"parallel": {"micro_batches": 2}, "loss": {"name": "sapo"}, "old_logp": "current"},
        "grpo-r1": {"parallel": {"micro_batches": 2}, "loss": {"name": "grpo"}, "old_logp": "current"},
    }
    for name, loss in AGG_LOSSES.items():
        for mb in (1, 4):
            cases[f"{name}-mb{mb}"] = {"parallel": {"micro_batches": mb}, "loss": loss}
    results = _spawn(hf_dir, data, 1, list(cases.values()))
    return {name: _merge(ranks) for name, ranks in zip(cases, results)}


@pytest.fixture(scope="module")
def logits_case():
    gen = torch.Generator().manual_seed(5)
    return {
        "logits": torch.randn(3, 10, 64, generator=gen) * 3.0,
        "labels": torch.randint(0, 64, (3, 10), generator=gen),
        "g_logp": torch.randn(3, 10, generator=gen),
        "g_ent": torch.randn(3, 10, generator=gen),
    }


@pytest.fixture(scope="module")
def two_procs(hf_dir, data, logits_case):
    cases = {
        "tp_logprobs": {
            "kind": "tp_logprobs",
            "parallel": {"tp": 2, "sequence_parallel": True},
            "variants": TP_VARIANTS,
            **logits_case,
        },
        "tp2-sp": _sapo_case({"tp": 2, "sequence_parallel": True, "micro_batches": 2}),
        "pp2": _sapo_case({"pp": 2, "micro_batches": 4}),
        "dp2": _sapo_case({"micro_batches": 2}),
        "cp2": _sapo_case({"cp": 2, "micro_batches": 2}),
    }
    for name, loss in AGG_LOSSES.items():  # context parallelism splits each sequence over the two ranks
        cases[f"cp2-{name}"] = {"parallel": {"cp": 2, "micro_batches": 1}, "loss": loss}
    results = _spawn(hf_dir, data, 2, list(cases.values()))
    return dict(zip(cases, results))


def _merge(ranks):
    """One step's view: rank 0's scalars, every rank's owned weights, the forward-only outputs in row order."""
    weights = {}
    for r in ranks:
        assert not set(weights) & set(r["weights"]), "a tensor was exported by two ranks"
        weights.update(r["weights"])
    current = {}
    for r in ranks:
        if r["current"] is not None and r["tp_rank"] == 0:
            current[r["dp_rank"]] = r["current"]
    return {
        "loss": ranks[0]["loss"],
        "grad_norm": ranks[0]["grad_norm"],
        "metrics": ranks[0]["metrics"],
        "weights": weights,
        "current": torch.cat([current[k] for k in sorted(current)], dim=1),
    }


def _max_weight_diff(a, b):
    assert set(a["weights"]) == set(b["weights"])
    return max((a["weights"][n] - b["weights"][n]).abs().max().item() for n in a["weights"])


def _assert_same_step(ref, got, loss_rtol=LOSS_RTOL, weight_atol=WEIGHT_ATOL):
    assert got["loss"] == pytest.approx(ref["loss"], rel=loss_rtol)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=loss_rtol)
    assert set(got["metrics"]) == set(ref["metrics"])
    for name, value in ref["metrics"].items():
        assert got["metrics"][name] == pytest.approx(value, rel=METRIC_RTOL, abs=METRIC_ATOL), name
    worst = _max_weight_diff(ref, got)
    assert worst <= weight_atol, f"updated weights differ by {worst:.3g}"


def test_reference_step_is_realistic(single, data):
    ref = single["ref"]
    metrics = ref["metrics"]
    assert ref["loss"] == pytest.approx(metrics["loss/total"], rel=1e-6)  # loss/* are reported as sums
    assert ref["grad_norm"] > 1e-3
    assert 0.9 < metrics["ratio/mean"] < 1.2 and metrics["sapo/w_mean"] < 0.99  # off-policy: ratios ≠ 1
    assert 0 < metrics["sapo/w_mean_neg"] < 1 and 0 < metrics["sapo/w_mean_pos"] < 1
    assert metrics["mismatch/is_weight_mean"] != pytest.approx(1.0)
    assert 3.5 < metrics["entropy"] < 4.2  # ~ln 64 for a random model
    assert "ratio/max" not in metrics  # extrema do not travel as (sum, weight)
    # The trainer's forward-only log-probs are the HF model's.
    mask = data["loss_mask"].bool()
    torch.testing.assert_close(ref["current"][0][mask], data["hf_logp"][mask], atol=1e-4, rtol=0)


def test_micro_batch_split_does_not_change_the_step(single):
    _assert_same_step(single["ref"], single["mb4"])


@pytest.mark.parametrize("name", list(AGG_LOSSES))
def test_every_aggregation_mode_is_micro_batch_invariant(single, name):
    one, four = single[f"{name}-mb1"], single[f"{name}-mb4"]
    _assert_same_step(one, four)
    assert one["grad_norm"] > 1e-3


@pytest.mark.parametrize("name", list(AGG_LOSSES))
def test_every_aggregation_mode_is_context_parallel_invariant(single, two_procs, name):
    """CP2: each sequence in 4 chunks over 2 ranks; sequence means, token counts and GSPO's sequence ratios
    still come out as in one process (the log-probs are gathered back whole before the loss)."""
    _assert_same_step(single[f"{name}-mb1"], _merge(two_procs[f"cp2-{name}"]))


def test_aggregation_modes_differ(single):
    losses = [single[f"{name}-mb1"]["loss"] for name in AGG_LOSSES if name.startswith("sapo")]
    assert len({round(x, 6) for x in losses}) == 3


@pytest.mark.parametrize("layout", ["tp2-sp", "pp2", "dp2", "cp2"])
def test_layout_matches_single_process(single, two_procs, layout):
    got = _merge(two_procs[layout])
    _assert_same_step(single["ref"], got)
    torch.testing.assert_close(got["current"], single["ref"]["current"], atol=1e-5, rtol=0)


def test_sapo_at_ratio_one_is_the_plain_policy_gradient(single):
    sapo, grpo = single["sapo-r1"], single["grpo-r1"]
    assert sapo["metrics"]["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert sapo["metrics"]["sapo/w_mean"] == pytest.approx(1.0, abs=1e-6)
    assert grpo["metrics"]["clip/frac"] == 0
    assert sapo["grad_norm"] == pytest.approx(grpo["grad_norm"], rel=1e-5)
    assert _max_weight_diff(sapo, grpo) <= WEIGHT_ATOL
    # Not vacuous: off-policy SAPO moves the weights differently.
    assert _max_weight_diff(sapo, single["sapo-seq-mean-token-mean-mb1"]) > 1e-4


def test_bf16_model_trains_with_fp32_log_probs(single):
    bf16, ref = single["bf16"], single["ref"]
    assert bf16["current"].dtype == torch.float32
    assert bf16["loss"] == pytest.approx(ref["loss"], rel=5e-2)
    assert bf16["metrics"]["entropy"] == pytest.approx(ref["metrics"]["entropy"], rel=1e-2)


@pytest.mark.parametrize("variant", list(TP_VARIANTS))
def test_tp2_log_probs_entropy_and_gradients_equal_single_process(two_procs, logits_case, variant):
    spec = TP_VARIANTS[variant]
    logits = logits_case["logits"].to(spec["dtype"], copy=True).requires_grad_()
    logp, entropy = naive(logits, logits_case["labels"], temperature=spec["temperature"])
    (logp * logits_case["g_logp"] + entropy * logits_case["g_ent"]).sum().backward()
    ranks = sorted(two_procs["tp_logprobs"], key=lambda r: r["tp_rank"])
    shards = [r["variants"][variant] for r in ranks]
    grad_atol = 2e-6 if spec["dtype"] == torch.float32 else 4e-3
    for shard in shards:  # every TP rank holds the full-vocabulary values
        torch.testing.assert_close(shard["logp"], logp.detach(), atol=2e-5, rtol=0)
        torch.testing.assert_close(shard["entropy"], entropy.detach(), atol=2e-5, rtol=0)
    grad = torch.cat([s["grad"] for s in shards], dim=-1)
    assert grad.dtype == spec["dtype"]
    torch.testing.assert_close(grad.float(), logits.grad.float(), atol=grad_atol, rtol=0)
