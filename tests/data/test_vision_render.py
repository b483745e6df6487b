"""Rendering prompts with images: <image> written as the VL chat templates write an image, each image pad expanded to
grid.prod() / merge² tokens of transformers' image processor, mm_token_type_ids, collapsing for SGLang, and the
data loading of a run (dry run) with a VL tokenizer directory."""

from __future__ import annotations

import json

import pytest

from sapo_megatron.data.datasets import DatasetKeys, read_dataset
from sapo_megatron.data.prompts import DatasetError
from sapo_megatron.data.render import PromptRenderer, apply_length_policy
from sapo_megatron.data.tokenizer import load_tokenizer
from sapo_megatron.data.vision import IMAGE_MARKUP, load_image_processor, pixel_inputs, vision_spec
from tests.data.test_images import png, uri
from tests.vl_fixtures import make_vl_tokenizer

pytest.importorskip("pyarrow")


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_vl_tokenizer(tmp_path_factory.mktemp("vltok"))


@pytest.fixture(scope="module")
def setup(vl_dir):
    tok = load_tokenizer(str(vl_dir))
    processor = load_image_processor(vl_dir)
    return tok, processor, vision_spec(tok, processor, str(vl_dir))


def rows_with_images(tmp_path, setup, prompt="Compare <image> with <image>.", sizes=((32, 48), (64, 16))):
    _, _, spec = setup
    images = [uri(png(w, h)) for h, w in sizes]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "ground_truth": "x", "images": images}) + "\n")
    keys = DatasetKeys(apply_chat_template=True)
    return read_dataset(
        path, keys, keys.image_policy(spec.factor, spec.min_pixels, spec.max_pixels)
    ).rows, keys


def test_spec_from_the_processor_and_tokenizer(setup):
    tok, processor, spec = setup
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"  # no torchvision here: the PIL one
    assert (spec.patch_size, spec.merge_size, spec.factor) == (8, 2, 16)
    assert (spec.min_pixels, spec.max_pixels) == (256, 4096)
    assert tok.hf.convert_tokens_to_ids("<|image_pad|>") == spec.pad_id


def test_expansion_matches_the_image_processor_grid(tmp_path, setup):
    tok, processor, spec = setup
    rows, keys = rows_with_images(tmp_path, setup)
    renderer = PromptRenderer(tok, keys, spec)
    ids = renderer.encode(rows[0])
    grid = pixel_inputs(processor, [image.load() for image in rows[0].images])["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 6], [1, 8, 2]]  # 32x48 and 64x16 pixels in 8-pixel patches
    expected_pads = [int(g.prod()) // 4 for g in grid]  # merge 2 x 2
    assert expected_pads == [6, 4]
    # the rendered text has one pad per image; the ids have them expanded, in the images' order
    text = renderer.text(rows[0])
    assert text.count(IMAGE_MARKUP) == 2 and "<image>" not in text
    short = renderer.encode_text(text)
    assert spec.collapse(ids) == short
    runs, run = [], 0
    for token in [*ids, -1]:
        if token == spec.pad_id:
            run += 1
        elif run:
            runs, run = [*runs, run], 0
    assert runs == expected_pads
    assert len(ids) == len(short) + sum(expected_pads) - 2
    assert renderer.encode_many(rows) == [ids]  # the batch path expands too
    assert spec.mm_token_type_ids(ids) == [int(t == spec.pad_id) for t in ids]
    assert sum(spec.mm_token_type_ids(ids)) == 10


def test_a_literal_image_pad_in_the_text_is_refused(tmp_path, setup):
    tok, _, spec = setup
    rows, keys = rows_with_images(tmp_path, setup, prompt="<image> and <|image_pad|>", sizes=((16, 16),))
    with pytest.raises(DatasetError, match=r"the rendered prompt has 2 image-pad tokens for 1 images"):
        PromptRenderer(tok, keys, spec).encode(rows[0])


def test_prompts_with_images_are_never_truncated(tmp_path, setup):
    tok, _, spec = setup
    rows, keys = rows_with_images(tmp_path, setup)
    keys = keys.model_copy(update={"max_prompt_tokens": 8, "overlong_prompts": "truncate_left"})
    renderer = PromptRenderer(tok, keys, spec)
    with pytest.raises(DatasetError, match="a prompt with images is never truncated"):
        apply_length_policy(rows, renderer, keys, str(tmp_path / "d.jsonl"))
    filtered = keys.model_copy(update={"overlong_prompts": "filter", "max_prompt_tokens": 8})
    with pytest.raises(DatasetError, match="none is left"):
        apply_length_policy(rows, PromptRenderer(tok, filtered, spec), filtered, "d")


def test_run_data_checks_every_image_then_refuses_a_text_model(tmp_path, vl_dir, setup):
    from sapo_megatron.config import config_from_dict
    from sapo_megatron.data.loading import build_run_data
    from sapo_megatron.errors import ConfigError
    from sapo_megatron.model.tiny import tiny_hf_config

    tok, _, spec = setup
    path = tmp_path / "train.jsonl"
    records = [
        {"prompt": f"<image> colour {i}?", "ground_truth": "red", "images": uri(png(40 + i, 40))}
        for i in range(3)
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    data = {"train": str(path), "tokenizer": str(vl_dir), "apply_chat_template": True}
    # a text LM whose vocabulary fits the tokenizer: the VL model's config is the model issue's
    cfg = config_from_dict(
        {
            "model": {"hf_config": tiny_hf_config("moe", vocab_size=400)},
            "rollout": {"max_new_tokens": 16},
            "data": data,
        }
    )
    with pytest.raises(
        ConfigError, match=r"data.train: 3 prompts have images \(3 images, all read and checked\)"
    ):
        build_run_data(cfg, verbose=True, log=lambda line: None)
    # a corrupt image is named before that
    records[2]["images"] = uri(png(16, 16)[:50])
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(DatasetError, match=rf"{path}:3 field images\[0\]: (corrupt image|not an image)"):
        build_run_data(cfg, verbose=True, log=lambda line: None)
    keys = cfg.data
    records[2]["images"] = uri(png(42, 40))
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    rows = read_dataset(path, keys, keys.image_policy(spec.factor, spec.min_pixels, spec.max_pixels)).rows
    ids = PromptRenderer(tok, keys, spec).encode(rows[0])
    assert (
        sum(t == spec.pad_id for t in ids) == 4
    )  # 40x40 -> 32x32 (40 / 16 = 2.5 rounds to 2): 16 patches / 4
