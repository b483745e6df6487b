"""Qwen3-VL-MoE conversion: HF (either fused-expert layout) → Megatron → HF is bitwise, the export is the hub
layout that transformers loads into the same model, mixed expert storage is refused, and ``verify`` names a
perturbed vision or DeepStack tensor."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from safetensors.torch import save_file

from sapo_megatron.checkpoint.fused_experts import FusedExpertsError, per_expert_view, unfuse
from sapo_megatron.checkpoint.hf_io import HFCheckpointReader
from sapo_megatron.conversion.convert import ConversionError, hf_to_megatron, megatron_to_hf, verify
from sapo_megatron.model.arch import QwenArch
from sapo_megatron.model.tiny import make_tiny_hf_checkpoint, tiny_vl_hf_config, vl_batch
from tests.checkpoint.conftest import assert_bitwise_equal, read_hf_tensors

GATE_UP = "model.language_model.layers.{}.mlp.experts.gate_up_proj"
DOWN = "model.language_model.layers.{}.mlp.experts.down_proj"
E, H, FFN = 4, 32, 24  # the tiny model's experts, hidden and expert FFN sizes: H, I and 2I all differ


def _per_expert(directory) -> dict[str, torch.Tensor]:
    reader = HFCheckpointReader(directory)
    try:
        return {name: reader.get(name) for name in reader.names()}
    finally:
        reader.close()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """transformers' own save: fused experts in its in-memory layout [E, 2I, H] / [E, H, I]."""
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("vl") / "hf", "vl_moe", seed=3)


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("vl-conv")
    mcore = hf_to_megatron(hf_dir, root / "mcore", progress=False)
    return mcore, megatron_to_hf(mcore, root / "export", hf_reference=hf_dir, progress=False)


def test_transformers_saves_its_layout_and_the_export_writes_the_hub_layout(hf_dir, converted):
    saved, exported = read_hf_tensors(hf_dir), read_hf_tensors(converted[1])
    assert saved[GATE_UP.format(0)].shape == (E, 2 * FFN, H) and saved[DOWN.format(0)].shape == (E, H, FFN)
    assert exported[GATE_UP.format(0)].shape == (E, H, 2 * FFN) and exported[DOWN.format(0)].shape == (
        E,
        FFN,
        H,
    )
    assert torch.equal(exported[GATE_UP.format(2)], saved[GATE_UP.format(2)].transpose(1, 2))
    assert torch.equal(exported[DOWN.format(2)], saved[DOWN.format(2)].transpose(1, 2))
    assert set(exported) == set(saved)  # vision tower, DeepStack mergers, LM: nothing lost, nothing added


def test_round_trip_is_bitwise_from_either_layout(hf_dir, converted, tmp_path):
    _, exported = converted
    assert_bitwise_equal(_per_expert(exported), _per_expert(hf_dir))
    # the hub-layout export converts again to the same Megatron weights: the second export is byte-for-byte
    again = megatron_to_hf(
        hf_to_megatron(exported, tmp_path / "mcore2", progress=False), tmp_path / "hf2", progress=False
    )
    assert_bitwise_equal(read_hf_tensors(again), read_hf_tensors(exported))


def test_transformers_loads_the_hub_layout_export_into_the_same_model(hf_dir, converted):
    arch = QwenArch.from_hf_dict(tiny_vl_hf_config())
    batch = vl_batch(arch, [[3, (32, 32), 5], [9]], seed=1)
    original = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(hf_dir).eval()
    loaded = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(converted[1]).eval()
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, original(**batch).logits)


@pytest.mark.parametrize(("hidden", "inter"), [(32, 24), (32, 16), (16, 16)], ids=["H≠I≠2I", "H=2I", "H=I"])
def test_layout_is_recognised_from_the_pair_of_shapes(hidden, inter):
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(3, 2 * inter, hidden, generator=gen)  # transformers' layout
    down = torch.randn(3, hidden, inter, generator=gen)
    prefix = "model.language_model.layers.0.mlp.experts"
    ours = unfuse({f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down})
    hub = unfuse(
        {f"{prefix}.gate_up_proj": gate_up.transpose(1, 2), f"{prefix}.down_proj": down.transpose(1, 2)}
    )
    assert_bitwise_equal(hub, ours)
    assert torch.equal(ours[f"{prefix}.1.gate_proj.weight"], gate_up[1, :inter])
    assert torch.equal(ours[f"{prefix}.1.up_proj.weight"], gate_up[1, inter:])
    assert torch.equal(ours[f"{prefix}.2.down_proj.weight"], down[2])


def test_fused_shapes_of_no_known_layout_are_refused():
    prefix = "model.language_model.layers.0.mlp.experts"
    with pytest.raises(FusedExpertsError, match="fit neither the hub layout"):
        per_expert_view({f"{prefix}.gate_up_proj": (4, 32, 40), f"{prefix}.down_proj": (4, 24, 32)})
    with pytest.raises(FusedExpertsError, match="down_proj is missing"):
        per_expert_view({f"{prefix}.gate_up_proj": (4, 32, 48)})


def test_checkpoint_mixing_fused_and_per_expert_tensors_is_refused(hf_dir, tmp_path):
    tensors = read_hf_tensors(hf_dir)
    split = unfuse({k: v for k, v in tensors.items() if ".layers.1.mlp.experts." in k})
    mixed = {k: v for k, v in tensors.items() if ".layers.1.mlp.experts." not in k} | split
    (tmp_path / "hf").mkdir()
    shutil.copy(hf_dir / "config.json", tmp_path / "hf" / "config.json")
    save_file(mixed, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"mixes fused expert tensors .* with per-expert ones"):
        hf_to_megatron(tmp_path / "hf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name",
    ["model.visual.patch_embed.proj.weight", "model.visual.deepstack_merger_list.1.linear_fc2.bias"],
    ids=["vision", "deepstack"],
)
def test_verify_passes_and_names_a_perturbed_vision_tensor(hf_dir, converted, tmp_path, name):
    report = verify(hf_dir, converted[0], log=None)
    assert report.ok and report.differing == () and report.max_abs <= 1e-5
    perturbed = tmp_path / "hf"
    shutil.copytree(hf_dir, perturbed)
    tensors = read_hf_tensors(perturbed)
    tensors[name].view(-1)[0] += 1e-3
    save_file(tensors, perturbed / "model.safetensors", metadata={"format": "pt"})
    report = verify(perturbed, converted[0], log=None)
    assert not report.ok and report.differing == (name,)
    assert name in report.summary()


def test_convert_verify_command_on_a_vl_checkpoint(hf_dir, converted, tmp_path, capsys):
    from sapo_megatron.cli import main

    assert (
        main(["convert", "verify", "--hf", str(hf_dir), "--megatron", str(converted[0]), "--batch", "3"]) == 0
    )
    out = capsys.readouterr().out
    assert "every weight equals the HF checkpoint's: OK" in out
    perturbed = tmp_path / "hf"
    shutil.copytree(hf_dir, perturbed)
    tensors = read_hf_tensors(perturbed)
    name = "model.visual.deepstack_merger_list.0.linear_fc1.weight"
    tensors[name].view(-1)[3] += 1e-3
    save_file(tensors, perturbed / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", "verify", "--hf", str(perturbed), "--megatron", str(converted[0])]) == 1
    out = capsys.readouterr().out
    assert f"1 tensors differ from the HF checkpoint: {name}" in out and "FAILED" in out


def test_dense_qwen3_vl_round_trip_and_verify(tmp_path):
    hf = make_tiny_hf_checkpoint(tmp_path / "hf", "vl_dense", seed=2)
    mcore = hf_to_megatron(hf, tmp_path / "mcore", progress=False)
    out = megatron_to_hf(mcore, tmp_path / "back", progress=False)
    assert_bitwise_equal(read_hf_tensors(out), read_hf_tensors(hf))
    report = verify(hf, mcore, log=None)
    assert report.ok and report.max_abs <= 1e-5
