"""Rollout precision (fp32 / bf16 / block fp8): the quantisation math by hand, what is quantised, the mismatch it
creates on the demo architecture, re-quantisation on weight updates, and the server's SGLang flags."""

from __future__ import annotations

import copy
import re

import httpx
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.defaults import DEMO_MODEL
from sapo_megatron.model.tiny import tiny_hf_config
from sapo_megatron.rollout.cpu.engine import CPUEngine, RowSpec
from sapo_megatron.rollout.cpu.server import ServeError, precision_from_flags, serve
from sapo_megatron.rollout.precision import (
    PrecisionError,
    dequantize_blocks,
    fake_quantize_activation,
    fake_quantize_weight,
    quantize_blocks,
)
from sapo_megatron.rollout.types import SamplingParams
from tests.rollout.conftest import engine_from, load, make_moe_model, reference_logprobs

E4M3_REL_ERROR = 2.0**-4  # round-to-nearest with 3 mantissa bits: half an ulp, relative to the value
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # subnormal spacing 2^-9, in units of the scale


def e4m3_values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random e4m3-representable fp32 values in [-448, 448], 448 first in every row (so every row's amax is 448)."""
    gen = torch.Generator().manual_seed(seed)
    values = (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    values[:, 0] = 448.0
    return values


# ------------------------------------------------------------------------------------------------ quantisation
def test_block_scales_and_exact_round_trip_with_partial_edge_blocks():
    # 130 x 200 with 128 x 128 blocks: a full block, a 128 x 72 edge, a 2 x 128 edge and a 2 x 72 corner.
    scales = torch.tensor([[2.0, 0.5], [1 / 16, 0.0]])
    codes = torch.zeros(130, 200)
    codes[:128, :128] = e4m3_values((128, 128), 0)
    codes[:128, 128:] = e4m3_values((128, 72), 1)
    codes[128:, :128] = e4m3_values((2, 128), 2)  # the corner block stays all zero
    weight = codes * scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :200]

    q, scale = quantize_blocks(weight)
    # By hand: amax / 448 per block from the block's own entries (896, 224, 28), the all-zero corner at the floor.
    expected_scale = torch.tensor([[896.0, 224.0], [28.0, 1e-4]]) / 448
    assert q.dtype == torch.float8_e4m3fn and q.shape == (130, 200)
    torch.testing.assert_close(scale, expected_scale, rtol=0, atol=0)
    assert float(weight[:128, 128:].abs().max()) / 448 == float(scale[0, 1])  # padding never counts
    torch.testing.assert_close(q.float(), codes, rtol=0, atol=0)  # representable values keep their codes
    torch.testing.assert_close(dequantize_blocks(q, scale), weight, rtol=0, atol=0)
    torch.testing.assert_close(fake_quantize_weight(weight), weight, rtol=0, atol=0)


def test_block_quantisation_error_is_within_the_e4m3_bound():
    gen = torch.Generator().manual_seed(3)
    # Blocks of very different magnitudes, so each block's scale matters.
    weight = torch.randn(300, 260, generator=gen) * torch.logspace(-3, 1, 300)[:, None]
    q, scale = quantize_blocks(weight)
    assert scale.shape == (3, 3)
    scale_per_entry = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260]
    error = (dequantize_blocks(q, scale) - weight).abs()
    bound = E4M3_REL_ERROR * weight.abs() + E4M3_SUBNORMAL_HALF_STEP * scale_per_entry
    assert bool((error <= bound).all())
    normal = weight.abs() >= 2.0**-6 * scale_per_entry  # e4m3's smallest normal, in units of the scale
    worst = float((error[normal] / weight.abs()[normal]).max())
    assert 2.0**-5 < worst <= E4M3_REL_ERROR  # 3 mantissa bits: the worst case is close to 2^-4


def test_activation_quantisation_is_per_token_group_of_128():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 300, generator=gen)  # groups [0:128], [128:256] and a partial [256:300]
    x[:, 128:256] *= 1000.0
    out = fake_quantize_activation(x.to(torch.bfloat16))
    assert out.dtype == torch.float32 and out.shape == (5, 300)
    for lo, hi in ((0, 128), (128, 256), (256, 300)):
        group = x.to(torch.bfloat16).float()[:, lo:hi]
        scale = group.abs().amax(dim=1, keepdim=True) / 448
        by_hand = (group / scale).to(torch.float8_e4m3fn).float() * scale
        torch.testing.assert_close(out[:, lo:hi], by_hand, rtol=0, atol=0)
    changed = x.clone()
    changed[:, 256:] *= 50.0  # another group's scale does not leak into group 0
    torch.testing.assert_close(
        fake_quantize_activation(changed)[:, :128], fake_quantize_activation(x)[:, :128]
    )
    codes = e4m3_values((3, 128), 5) * 0.25  # scale 448 * 0.25 / 448: representable values round-trip
    torch.testing.assert_close(fake_quantize_activation(codes), codes, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------- what is quantised
def test_fp8_quantises_attention_and_expert_weights_only(moe_dir):
    original = dict(load(moe_dir).named_parameters())
    engine = engine_from(moe_dir, precision="fp8")
    params = dict(engine.model.named_parameters())
    expected = {
        f"model.layers.{i}.{name}"
        for i in range(2)
        for name in (
            *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
        )
    }
    assert engine.numerics.quantized == expected
    for name, param in params.items():
        if name in expected:
            assert param.dtype == torch.float32, name
        else:  # embeddings, norms, router gates, lm_head
            assert param.dtype == torch.bfloat16, name
            torch.testing.assert_close(param, original[name].to(torch.bfloat16), rtol=0, atol=0)
    assert {"model.layers.0.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight"} <= (
        set(params) - expected
    )
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    torch.testing.assert_close(params[q_proj], fake_quantize_weight(original[q_proj]), rtol=0, atol=0)
    assert not torch.equal(params[q_proj], original[q_proj])
    # Each expert's gate and up matrices are blocked on their own, as the checkpoint stores them.
    fused, source = (
        params["model.layers.0.mlp.experts.gate_up_proj"],
        original["model.layers.0.mlp.experts.gate_up_proj"],
    )
    half = fused.shape[1] // 2
    torch.testing.assert_close(fused[3, half:], fake_quantize_weight(source[3, half:]), rtol=0, atol=0)
    assert not torch.equal(fused[3], fake_quantize_weight(source[3]))


def test_dense_fp8_quantises_mlp_projections(dense_dir):
    engine = engine_from(dense_dir, precision="fp8")
    assert engine.numerics.quantized == {
        f"model.layers.{i}.{module}.{p}_proj.weight"
        for i in range(2)
        for module, projs in (("self_attn", ("q", "k", "v", "o")), ("mlp", ("gate", "up", "down")))
        for p in projs
    }


def test_unknown_precision_is_refused(moe_dir):
    with pytest.raises(PrecisionError, match="'fp16' is not one of fp32, bf16, fp8"):
        engine_from(moe_dir, precision="fp16")


# ------------------------------------------------------------------------------- mismatch on the demo model
@pytest.fixture(scope="module")
def demo_engines():
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in DEMO_MODEL.items() if k != "model_type"})
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    reference = copy.deepcopy(model)
    engines = {
        p: CPUEngine(copy.deepcopy(model), precision=p, num_threads=1) for p in ("fp32", "bf16", "fp8")
    }
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, config.vocab_size, (20,), generator=gen).tolist() for _ in range(16)]
    return reference, engines, sequences


def routes(engine: CPUEngine, sequences: list[list[int]]) -> np.ndarray:
    """Sorted top-k experts per token and layer of teacher-forced sequences: [seqs, len - 1, layers, k]."""
    rows = [RowSpec(s, SamplingParams(max_new_tokens=0), return_routed_experts=True) for s in sequences]
    return np.sort(np.stack([r.routed_experts for r in engine.generate_rows(rows)]), axis=-1)


def test_bf16_and_fp8_engines_mismatch_the_fp32_engine(demo_engines):
    reference, engines, sequences = demo_engines
    logp = {p: np.concatenate(e.score(sequences, 4)) for p, e in engines.items()}
    expected = np.concatenate([reference_logprobs(reference, s, 4) for s in sequences])
    stats = {}
    for precision, values in logp.items():
        delta = values - expected
        stats[precision] = (float(np.mean(np.exp(delta) - delta - 1)), float(np.abs(delta).mean()))
    print("k3, mean |delta| against fp32:", stats)
    assert stats["fp32"][1] < 1e-6  # the fp32 engine is the trainer's model
    assert 0 < stats["bf16"][0] < stats["fp8"][0]
    assert stats["fp32"][1] < 1e-4 < stats["bf16"][1] < stats["fp8"][1] < 0.02  # close, not broken


def test_fp8_changes_moe_routing(demo_engines):
    _, engines, sequences = demo_engines
    live = routes(engines["fp32"], sequences)
    agreement = {p: float((routes(engines[p], sequences) == live).all(-1).mean()) for p in ("bf16", "fp8")}
    print("routing agreement with fp32 (token-layers with the same top-k set):", agreement)
    assert 0.5 < agreement["fp8"] < agreement["bf16"] < 1.0


# ------------------------------------------------------------------------------------------- weight updates
def hf_named_tensors(model_dir) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under their on-disk names (per-expert gate/up/down), as a trainer sends them."""
    return sorted(safetensors.torch.load_file(str(model_dir / "model.safetensors")).items())


def scores(engine: CPUEngine) -> np.ndarray:
    sequences = [[1, 5, 9, 2, 7, 3, 11, 4], [6, 2, 8, 8, 1, 9]]
    return np.concatenate(engine.score(sequences, 2))


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_weight_updates_reapply_the_engines_precision(precision, moe_dir, moe_dir_b):
    fresh = scores(engine_from(moe_dir_b, precision=precision))
    from_tensors = engine_from(moe_dir, precision=precision)
    before = scores(from_tensors)
    from_tensors.update_weights_from_tensors(hf_named_tensors(moe_dir_b))
    np.testing.assert_array_equal(scores(from_tensors), fresh)
    assert np.abs(before - fresh).max() > 1e-3
    fused = engine_from(moe_dir, precision=precision)  # the model's own (fused) parameter names
    fused.update_weights_from_tensors(make_moe_model(1).named_parameters())
    np.testing.assert_array_equal(scores(fused), fresh)
    from_disk = engine_from(moe_dir, precision=precision)
    from_disk.update_weights_from_disk(str(moe_dir_b))
    np.testing.assert_array_equal(scores(from_disk), fresh)


def test_one_expert_update_requantises_that_expert_only(moe_dir):
    engine = engine_from(moe_dir, precision="fp8")
    fused = engine.model.model.layers[1].mlp.experts.gate_up_proj
    before = fused.detach().clone()
    new_gate = torch.randn(fused.shape[1] // 2, fused.shape[2], generator=torch.Generator().manual_seed(6))
    engine.update_weights_from_tensors([("model.layers.1.mlp.experts.5.gate_proj.weight", new_gate)])
    half = fused.shape[1] // 2
    torch.testing.assert_close(fused[5, :half], fake_quantize_weight(new_gate), rtol=0, atol=0)
    torch.testing.assert_close(fused[5, half:], before[5, half:], rtol=0, atol=0)
    torch.testing.assert_close(fused[:5], before[:5], rtol=0, atol=0)


# -------------------------------------------------------------------------------------------------- server
def test_sglang_flags_map_to_precisions():
    assert precision_from_flags() == "fp32"
    assert precision_from_flags("float") == precision_from_flags("float32") == "fp32"
    assert precision_from_flags("bfloat16") == "bf16"
    assert precision_from_flags("auto", "fp8") == precision_from_flags("bfloat16", "fp8") == "fp8"
    with pytest.raises(ServeError, match="not float16"):
        precision_from_flags("half")
    with pytest.raises(ServeError, match="fp8 runs bfloat16 activations"):
        precision_from_flags("float32", "fp8")
    with pytest.raises(ServeError, match="implements only fp8"):
        precision_from_flags("auto", "awq")


def generate(url: str, prompt: list[int]) -> dict:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    reply = httpx.post(url + "/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def in_process(engine: CPUEngine, prompt: list[int]):
    row = RowSpec(prompt, SamplingParams(max_new_tokens=5, temperature=0.0), logprob_start_len=0)
    return engine.generate_rows([row])[0]


def test_served_fp8_equals_in_process_fp8_before_and_after_a_weight_update(moe_dir, moe_dir_b):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    server = serve(moe_dir, port=0, num_threads=1, block=False, precision=precision_from_flags("auto", "fp8"))
    try:
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        assert (info["dtype"], info["quantization"]) == ("bfloat16", "fp8")
        for model_dir in (moe_dir, moe_dir_b):
            if model_dir != moe_dir:
                reply = httpx.post(
                    server.url + "/update_weights_from_disk", json={"model_path": str(model_dir)}, timeout=60
                )
                assert reply.json()["success"], reply.text
            served = generate(server.url, prompt)
            expected = in_process(engine_from(model_dir, precision="fp8"), prompt)
            assert served["output_ids"] == expected.output_ids
            meta = served["meta_info"]
            assert [lp for lp, _, _ in meta["output_token_logprobs"]] == expected.output_logprobs
            assert [lp for lp, _, _ in meta["input_token_logprobs"]] == expected.input_logprobs
            assert expected.output_logprobs != in_process(engine_from(model_dir), prompt).output_logprobs
    finally:
        server.stop()


def test_config_names_the_precision_choices():
    raw = {"model": {"hf_config": tiny_hf_config("moe")}, "rollout": {"precision": "fp16"}}
    with pytest.raises(
        ConfigError, match=re.escape("rollout.precision: Input should be 'fp32', 'bf16' or 'fp8'")
    ):
        config_from_dict(raw)
    raw["rollout"]["precision"] = "fp8"
    assert config_from_dict(raw).rollout.precision == "fp8"
