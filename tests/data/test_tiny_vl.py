"""``model.hf_config: tiny_vl`` (issue 38, Build 7): a VL model without writing a config. It is the CPU VL demo's
tiny Qwen3-VL-MoE with the image ids, vocabulary and end-of-text id of ``data.tokenizer`` (a VL tokenizer folder,
as ``vl_demo --tokenizer-only`` writes it) and the context the prompts – images expanded – need, as ``tiny``
sizes itself. Fails before this test: 'tiny_vl' was read as a path to a config file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sapo_megatron.config import ConfigError, config_from_dict, load_config
from sapo_megatron.data.qwen3_tokenizer import PADDED_VOCAB_SIZE
from sapo_megatron.data.vl_demo import main as write_demo_inputs
from sapo_megatron.data.vl_demo import vl_model_ids

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("vl") / "data"
    write_demo_inputs([str(data), "--train", "16", "--heldout", "4"])
    return data


def demo_raw(data: Path) -> dict:
    raw = yaml.safe_load((REPO / "configs/demo_tiny_vl_moe_cpu.yaml").read_text())
    raw["data"].update(train=str(data / "train.jsonl"), tokenizer=str(data / "tokenizer"))
    raw["eval"]["datasets"][0]["path"] = str(data / "heldout.jsonl")
    return raw


def test_tiny_vl_is_the_vl_demo_model_sized_to_the_data(demo_data):
    """With the demo's tokenizer it is the demo config's model, but for the context, which follows the prompts: a
    32x32 image is 4 tokens, the prompt ~30, the response 6 – 64, where the demo file says 256."""
    raw = demo_raw(demo_data)
    written = raw["model"]["hf_config"]
    raw["model"]["hf_config"] = "tiny_vl"
    cfg = config_from_dict(raw)
    hf = cfg.model.hf_config
    assert isinstance(hf, dict) and hf["text_config"]["max_position_embeddings"] == 64
    assert {**hf, "text_config": {**hf["text_config"], "max_position_embeddings": 256}} == written
    arch = cfg.model.arch
    assert arch.is_vl and arch.vocab_size == 516 and arch.max_position_embeddings == 64
    # the measured context holds every prompt with its image tokens plus max_new_tokens
    from sapo_megatron.data.loading import build_run_data

    data = build_run_data(cfg)
    longest = max(len(data.renderer.encode(row)) for row in data.train_rows)
    assert data.vision is not None and any(row.images for row in data.train_rows)
    assert longest + cfg.rollout.max_new_tokens <= 64 < longest + cfg.rollout.max_new_tokens + 64


@pytest.mark.slow  # the real Qwen3 tokenizer, 151k tokens
def test_tiny_vl_on_the_real_qwen3_tokenizer(tmp_path, demo_data):
    """``--base qwen3``: Qwen3's own image ids and the vocabulary padded as the real checkpoints are."""
    write_demo_inputs([str(tmp_path), "--tokenizer-only", "--base", "qwen3"])
    raw = demo_raw(demo_data)
    raw["data"]["tokenizer"] = str(tmp_path / "tokenizer")
    raw["model"]["hf_config"] = "tiny_vl"
    hf = config_from_dict(raw).model.hf_config
    assert isinstance(hf, dict)
    assert (hf["vision_start_token_id"], hf["image_token_id"], hf["vision_end_token_id"]) == (
        151652,
        151655,
        151653,
    )
    assert hf["text_config"]["vocab_size"] == PADDED_VOCAB_SIZE == 151_936
    assert hf["text_config"]["eos_token_id"] == 151645  # <|im_end|>, the eos of Qwen3's tokenizer_config
    assert vl_model_ids(tmp_path / "tokenizer")["video_token_id"] == hf["video_token_id"]


def test_tiny_vl_without_a_vl_tokenizer_is_one_line(tmp_path, demo_data):
    raw = demo_raw(demo_data)
    raw["model"]["hf_config"] = "tiny_vl"
    raw["data"]["tokenizer"] = "chat"
    with pytest.raises(
        ConfigError, match=r"tiny_vl needs data\.tokenizer to be a VL tokenizer folder"
    ) as refused:
        config_from_dict(raw)
    assert "vl_demo OUT --tokenizer-only" in str(refused.value.hint)


def test_tiny_vl_in_a_yaml_file_is_not_a_path(tmp_path, demo_data):
    """``tiny_vl`` in a file is the name, not a path relative to the file's folder (as ``tiny``)."""
    raw = demo_raw(demo_data)
    raw["model"]["hf_config"] = "tiny_vl"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert load_config(path).model.arch.is_vl
