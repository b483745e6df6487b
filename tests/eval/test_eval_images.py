"""Eval datasets with images on the CPU engine (a tiny Qwen3-VL-MoE): the eval runner sends each row's images with
its request as the rollout does, so greedy eval answers equal the rollout path's answers to the same prompts; a text
model refuses an eval set with images by name before any generation."""

from __future__ import annotations

import json

import pytest

from sapo_megatron.algo import AdvantageConfig
from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.data.tokenizer import load_tokenizer
from sapo_megatron.eval.runner import build_suite, run_suite
from sapo_megatron.model.tiny import tiny_hf_config
from sapo_megatron.rollout.collect import CollectSettings, generate_groups
from sapo_megatron.rollout.cpu.engine import CPUEngine
from sapo_megatron.rollout.types import SamplingParams
from tests.data.test_images import png, uri
from tests.vl_fixtures import build_tiny_vl_checkpoint

pytestmark = pytest.mark.slow

MAX_NEW = 6


@pytest.fixture(scope="module")
def vl_eval(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_eval")
    model = build_tiny_vl_checkpoint(root / "model", seed=4)
    records = [
        {
            "prompt": "Which colour is <image>?",
            "ground_truth": "red",
            "images": [uri(png(32, 48, (250, 0, 0)))],
        },
        {
            "prompt": "Which colour is <image>?",
            "ground_truth": "green",
            "images": [uri(png(40, 40, (0, 200, 0)))],
        },
        {"prompt": "Say 3.", "ground_truth": "3"},
    ]
    data = root / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return model, data


def _cfg(model, data, hf_config):
    return config_from_dict(
        {
            "model": {"hf_config": hf_config},
            "data": {"tokenizer": str(model), "apply_chat_template": True},
            "rollout": {"max_new_tokens": MAX_NEW},
            "algorithm": {"reward_workers": 0, "reward": "exact_match"},
            "eval": {"datasets": [{"name": "colours", "path": str(data), "n": 1, "temperature": 0.0}]},
        }
    )


def test_eval_rows_with_images_reach_the_engine(vl_eval):
    model, data = vl_eval
    cfg = _cfg(model, data, str(model))
    tokenizer = load_tokenizer(str(model))
    suite = build_suite(cfg, tokenizer, seed=1)
    prompts, rows = suite.prompts["colours"], suite.rows["colours"]
    assert [len(row.images) for row in rows] == [1, 1, 0]
    engine = CPUEngine.from_pretrained(model, seed=0)
    try:
        result = run_suite(engine, tokenizer, suite, seed=1)
        settings = CollectSettings(
            n_samples=1,
            sampling=SamplingParams(
                max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=(tokenizer.eos_id,)
            ),
            advantage=AdvantageConfig(),
            image_pad_id=prompts.renderer.vision.pad_id,
        )
        groups = generate_groups(engine, rows, prompts.encode, settings, seed=1)
        # the pixels change the answer: the same prompt text without its image is answered otherwise
        blind = engine.generate([r for r in _blind_requests(prompts, rows[:2], settings)])
    finally:
        engine.close()
    rollout = [tokenizer.decode(group[0].response_ids) for group in groups]
    assert [s["response"] for s in result.samples] == rollout
    print("eval answers:", rollout)
    assert [tokenizer.decode(g[0].response_ids) for g in blind] != rollout[:2]
    assert result.metrics["colours"]["num_prompts"] == 3


def _blind_requests(prompts, rows, settings):
    """The image rows' requests with their pads but no pixels (a zero image of the same size)."""
    import dataclasses

    from sapo_megatron.rollout.types import GenerationRequest

    for index, row in enumerate(rows):
        black = dataclasses.replace(prompts.images(row), png=(png(*row.images[0].size, (0, 0, 0)),))
        yield GenerationRequest(
            prompt_ids=prompts.encode(row), images=black, n=1, sampling=settings.sampling, group_id=index
        )


def test_a_text_model_refuses_an_eval_set_with_images(vl_eval):
    model, data = vl_eval
    with pytest.raises(ConfigError, match="eval dataset colours: 2 prompts have images"):
        build_suite(_cfg(model, data, tiny_hf_config()), load_tokenizer(str(model)), seed=1)
