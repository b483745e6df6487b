"""The CPU VL demo's inputs (``python -m sapo_megatron.data.vl_demo``): the tokenizer folder whose image tokens the
demo and evidence configs name by id, and the seeded mixed dataset."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from sapo_megatron.config import load_config
from sapo_megatron.data.loading import build_vision
from sapo_megatron.data.tokenizer import load_tokenizer
from sapo_megatron.data.vl_demo import main, write_demo_data
from sapo_megatron.errors import UserError

REPO = Path(__file__).resolve().parents[2]
CONFIGS = [
    "demo_tiny_vl_moe_cpu.yaml",
    "vl_evidence/sapo.yaml",
    "vl_evidence/gspo.yaml",
    "vl_evidence/grpo_r2.yaml",
]


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vl_demo")
    main([str(out), "--train", "8", "--heldout", "4", "--tasks", "name_colour,count_shapes", "--logic", "4",
          "--math", "2", "--seed", "5"])  # fmt: skip
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_the_configs_name_the_tokenizers_image_tokens(demo_data, name):
    """The configs hard-code the image token ids and the vocabulary: they must be the written tokenizer's."""
    cfg = load_config(REPO / "configs" / name)
    tokenizer = load_tokenizer(str(demo_data / "tokenizer"))
    vision = build_vision(cfg, tokenizer)
    arch = cfg.model.arch
    assert (vision.start_id, vision.pad_id, vision.end_id) == (512, 513, 514)
    assert (arch.vision_start_token_id, arch.image_token_id, arch.vision_end_token_id) == (512, 513, 514)
    assert tokenizer.vocab_size <= arch.vocab_size
    assert arch.eos_token_id == tokenizer.hf.eos_token_id
    # 64x64 drawings resized at load to 32x32: a 2x2 grid of merged patches, four image tokens
    assert vision.max_pixels == 32 * 32 and vision.tokens_for((32, 32)) == 4


def test_the_mixed_dataset_is_seeded_and_keeps_its_proportions(demo_data, tmp_path):
    rows = {split: _rows(demo_data / f"{split}.jsonl") for split in ("train", "heldout")}
    assert Counter(r["domain"] for r in rows["train"]) == {
        "name_colour": 4, "count_shapes": 4, "knights_knaves": 4, "math_addition": 2
    }  # fmt: skip
    assert Counter(r["domain"] for r in rows["heldout"]) == {
        "name_colour": 2, "count_shapes": 2, "knights_knaves": 2, "math_addition": 1
    }  # fmt: skip
    for row in rows["train"]:
        assert bool(row.get("images")) == (row["domain"] in ("name_colour", "count_shapes"))
        assert all((demo_data / image).is_file() for image in row.get("images", ()))
        if row["domain"] == "math_addition":
            a, b = (int(word) for word in row["prompt"].replace("?", "").split() if word.isdigit())
            assert row["ground_truth"] == str(a + b)
        if row["domain"] == "knights_knaves":  # two people, and the label names both
            assert row["ground_truth"].count(":") == 2
    write_demo_data(
        tmp_path, train=8, heldout=4, tasks=("name_colour", "count_shapes"), logic=4, math=2, seed=5
    )
    assert _rows(tmp_path / "train.jsonl") == rows["train"]  # the same arguments give the same rows
    assert rows["train"] != _rows(
        write_demo_data(tmp_path / "other", train=8, heldout=4, logic=4, seed=6) / "train.jsonl"
    )


def test_bad_counts_and_tasks_are_refused_by_name(tmp_path):
    with pytest.raises(UserError, match="train >= 1 and heldout >= 1"):
        write_demo_data(tmp_path, train=0, heldout=4)
    with pytest.raises(UserError, match="unknown visual task 'colours'"):
        write_demo_data(tmp_path, train=2, heldout=1, tasks=("colours",))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
