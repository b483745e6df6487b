"""Qwen3-VL-MoE under parallel layouts (2 and 4 processes over gloo): the logits on text + image rows equal
transformers', and one SFT step gives the loss, gradient norm and updated weights (vision tower included) of a
single process, in TP2+SP, EP2, PP2, TP2×EP2 and CP2 (each sequence in 4 chunks over 2 ranks: the 3-D MRoPE
positions, image tokens and DeepStack rows follow the chunks)."""

from __future__ import annotations

import pytest
import torch
import transformers

from sapo_megatron.model.arch import QwenArch
from sapo_megatron.model.tiny import make_tiny_hf_checkpoint, tiny_vl_hf_config, vl_batch
from tests.distributed import run_distributed

pytestmark = pytest.mark.slow

LOGIT_ATOL = 1e-5  # fp32 max |Δlogit| against transformers (measured: see docs/multimodal.md)
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-6
TEXT = {"num_hidden_layers": 6}  # PP2 keeps the 3 DeepStack layers on the first stage
# two images of different sizes, one image, text only, one image: rows end in text (labels shift by one)
ROWS = [[3, (32, 48), 4, (16, 16), 3], [5, (40, 24), 9], [14], [2, (16, 32), 8]]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("vl") / "hf", "vl_moe", seed=5, text=TEXT))


@pytest.fixture(scope="module")
def batch():
    arch = QwenArch.from_hf_dict(tiny_vl_hf_config(text=TEXT))
    out = vl_batch(arch, ROWS, seed=6)
    # the inputs (width - 1) split over 2 TP ranks (sequence parallelism) and into 4 chunks (CP2)
    extra = -(out["input_ids"].shape[1] - 1) % 4
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        out[key] = torch.nn.functional.pad(out[key], (0, extra))
    return out


@pytest.fixture(scope="module")
def hf_logits(hf_dir, batch):
    model = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(hf_dir).float().eval()
    inputs = {k: v[:, :-1] if k in ("input_ids", "attention_mask") else v for k, v in batch.items()}
    inputs["mm_token_type_ids"] = inputs["mm_token_type_ids"][:, :-1]
    with torch.no_grad():
        return model(**inputs).logits


def _run(hf_dir, batch, world, parallel):
    payload = {"hf_dir": hf_dir, "batch": batch, "world": world, "parallel": parallel}
    results = run_distributed("tests.megatron.vl_scenarios:vl_step", world, payload)
    weights = {}
    for r in results:
        assert not set(weights) & set(r["weights"]), "a tensor was exported by two ranks"
        weights.update(r["weights"])
    logits = [r["logits"] for r in results if r["logits"] is not None]
    assert len(logits) == 1
    return results[0], weights, logits[0]


@pytest.fixture(scope="module")
def reference(hf_dir, batch):
    return _run(hf_dir, batch, 1, {"micro_batches": 2})


def _logit_error(logits, hf_logits, batch) -> float:
    real = batch["attention_mask"][:, :-1].bool()
    return (logits - hf_logits)[real].abs().max().item()


def test_single_process_matches_transformers_and_learns(reference, hf_logits, batch):
    step, weights, logits = reference
    error = _logit_error(logits, hf_logits, batch)
    print(f"single process: max |Δlogit| vs transformers = {error:.2e}")  # pytest -s shows the measurement
    assert error <= LOGIT_ATOL
    assert 4.5 < step["loss"] < 6.5  # ~ln(256) for a random model
    assert step["grad_norm"] > 0
    assert any(n.startswith("model.visual.") for n in weights)


@pytest.mark.parametrize(
    ("world", "parallel"),
    [
        (2, {"tp": 2, "sequence_parallel": True, "micro_batches": 2}),
        (2, {"ep": 2, "micro_batches": 2}),
        (2, {"pp": 2, "micro_batches": 2}),
        (4, {"tp": 2, "ep": 2, "sequence_parallel": True, "micro_batches": 2}),
        (2, {"cp": 2, "micro_batches": 2}),
    ],
    ids=["tp2-sp", "ep2", "pp2", "tp2xep2", "cp2"],
)
def test_layout_matches_transformers_and_single_process(hf_dir, batch, hf_logits, reference, world, parallel):
    ref_step, ref_weights, _ = reference
    step, weights, logits = _run(hf_dir, batch, world, parallel)
    error = _logit_error(logits, hf_logits, batch)
    print(f"{parallel}: max |Δlogit| vs transformers = {error:.2e}")
    assert error <= LOGIT_ATOL
    assert step["loss"] == pytest.approx(ref_step["loss"], rel=LOSS_RTOL)
    assert step["grad_norm"] == pytest.approx(ref_step["grad_norm"], rel=LOSS_RTOL)
    assert set(weights) == set(ref_weights)
    worst = max((weights[n] - ref_weights[n]).abs().max().item() for n in ref_weights)
    assert worst <= WEIGHT_ATOL, f"updated weights differ by {worst:.3g}"
