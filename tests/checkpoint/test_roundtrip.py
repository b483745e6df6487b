"""HF → Megatron → HF is bitwise identical (fp32 and bf16, MoE and dense), and the output is a normal HF
checkpoint: sharded with an index when asked, loadable by transformers, tokenizer files copied."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from sapo_megatron.checkpoint import atomic
from sapo_megatron.conversion.convert import hf_to_megatron, megatron_to_hf
from sapo_megatron.data.tokenizer import CharTokenizer
from sapo_megatron.model.tiny import make_tiny_hf_checkpoint
from tests.checkpoint.conftest import KINDS, assert_bitwise_equal, read_hf_tensors


@pytest.mark.parametrize("key", KINDS)
def test_round_trip_is_bitwise(hf_checkpoints, converted, tmp_path, key):
    out = megatron_to_hf(converted[key], tmp_path / "hf", progress=False)
    assert_bitwise_equal(read_hf_tensors(out), read_hf_tensors(hf_checkpoints[key]))


def test_converted_directory_is_a_complete_megatron_checkpoint(hf_checkpoints, converted):
    path = converted["moe-bf16"]
    marker = atomic.read_marker(path)
    assert marker["kind"] == "model" and marker["dtype"] == "bfloat16"
    for name in (".metadata", "metadata.json", "common.pt", atomic.HF_CONFIG):
        assert (path / name).is_file(), name
    stored = json.loads((path / atomic.HF_CONFIG).read_text())
    assert stored == json.loads((hf_checkpoints["moe-bf16"] / "config.json").read_text())
    assert not list(path.parent.glob(".*partial*")), "temporary directory left behind"


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [("dense", {"tie_word_embeddings": True}), ("moe", {"mlp_only_layers": [1]})],
    ids=["dense-tied-embeddings", "moe-with-a-dense-layer"],
)
def test_round_trip_variants(tmp_path, kind, overrides):
    """Tied embeddings (no lm_head) and a mixed MoE/dense stack (per-layer checkpoint keys in Megatron)."""
    hf = make_tiny_hf_checkpoint(tmp_path / "hf", kind, seed=3, **overrides)
    mcore = hf_to_megatron(hf, tmp_path / "mcore", progress=False)
    out = megatron_to_hf(mcore, tmp_path / "back", progress=False)
    assert_bitwise_equal(read_hf_tensors(out), read_hf_tensors(hf))


def test_sharded_export_loads_in_transformers(hf_checkpoints, converted, tmp_path):
    hf = hf_checkpoints["moe-fp32"]
    (hf / "tokenizer_config.json").write_text('{"model_max_length": 256}\n')
    CharTokenizer().save(hf)
    out = megatron_to_hf(converted["moe-fp32"], tmp_path / "hf", hf, max_shard_bytes=40_000, progress=False)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files == sorted(p.name for p in out.glob("*.safetensors"))
    for name in files:
        assert (out / name).stat().st_size <= 40_000 + 4096  # shard bound + header
    assert (out / "tokenizer_config.json").is_file() and (out / "generation_config.json").is_file()
    assert CharTokenizer.load(out) == CharTokenizer()

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(hf).float().eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, original(input_ids=ids).logits)


def test_export_dtype_override(converted, tmp_path):
    out = megatron_to_hf(converted["moe-bf16"], tmp_path / "hf", dtype="fp32", progress=False)
    tensors = read_hf_tensors(out)
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
