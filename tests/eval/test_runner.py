"""The eval runner on a scripted engine: the seeds each request carries, the samples it records, a dataset's
reward refused by name, and a reward that keeps raising stopping the evaluation."""

from __future__ import annotations

import pytest

from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.data.tokenizer import CharTokenizer
from sapo_megatron.eval.runner import build_suite, eval_seed, run_suite
from sapo_megatron.model.tiny import tiny_hf_config
from sapo_megatron.rewards.registry import RewardError, register_reward
from sapo_megatron.rollout.types import Sample

TOKENIZER = CharTokenizer()


class ScriptedEngine:
    """Answers every prompt "12" for even sample indices and "13" (truncated) for odd ones."""

    def __init__(self) -> None:
        self.requests = []

    def generate(self, requests):
        self.requests += requests
        return [
            [
                Sample(
                    group_id=r.group_id,
                    sample_index=i,
                    prompt_ids=list(r.prompt_ids),
                    response_ids=TOKENIZER.encode("12" if i % 2 == 0 else "13"),
                    rollout_logp=[0.0, 0.0],
                    finish_reason="stop" if i % 2 == 0 else "length",
                )
                for i in range(r.n)
            ]
            for r in requests
        ]


def suite_for(tmp_path, reward="numeric_match", n=4):
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "5+7=", "ground_truth": "12", "domain": "x"}\n'
        '{"prompt": "6+7=", "ground_truth": "13", "domain": "y"}\n'
        '{"prompt": "9+9=", "ground_truth": "18", "domain": "y"}\n'
    )
    cfg = config_from_dict(
        {
            "model": {"hf_config": tiny_hf_config()},
            "rollout": {"max_new_tokens": 8},
            "algorithm": {"reward_workers": 0},  # inline: the test's reward exists in this process only
            "eval": {
                "datasets": [{"name": "d", "path": str(path), "n": n, "temperature": 1.0, "reward": reward}]
            },
        }
    )
    return build_suite(cfg, TOKENIZER, seed=5)


def test_requests_carry_fixed_seeds_and_samples_are_recorded(tmp_path):
    engine = ScriptedEngine()
    result = run_suite(engine, TOKENIZER, suite_for(tmp_path), seed=5)
    first = eval_seed(5, "d")
    assert [r.sampling.seed for r in engine.requests] == [first, first + 4, first + 8]
    assert [r.sampling.temperature for r in engine.requests] == [1.0] * 3
    d = result.metrics["d"]
    # prompt 0: "12" right twice of 4; prompt 1: "13" right twice; prompt 2: never
    assert d["avg@4"] == pytest.approx((0.5 + 0.5 + 0) / 3)
    assert d["pass@4"] == pytest.approx(2 / 3)
    assert d["maj@4"] == pytest.approx((1 + 0 + 0) / 3)  # "12" and "13" tie 2:2, the first seen ("12") wins
    assert d["truncated_frac"] == 0.5
    assert d["by_source"]["y"]["num_prompts"] == 2 and d["by_source"]["x"]["avg@4"] == 0.5
    assert result.samples[1] == {
        "dataset": "d",
        "index": 0,
        "sample": 1,
        "source": "x",
        "prompt": "5+7=",
        "response": "13",
        "score": 0.0,
        "answer": "13",
        "finish_reason": "length",
        "response_tokens": 2,
    }
    assert result.flat()["eval/d/y/avg@4"] == pytest.approx(0.25)


@register_reward("test_eval_raises")
def _raises(response: str, label: str) -> float:
    raise RuntimeError("broken reward")


def test_an_unknown_reward_is_named_and_a_raising_one_stops_the_evaluation(tmp_path):
    with pytest.raises(ConfigError, match=r"eval.datasets\[0\].reward='nope' is not a registered reward"):
        suite_for(tmp_path, reward="nope")
    with pytest.raises(
        RewardError, match=r"eval dataset d: reward 'test_eval_raises \(evaluation\)' failed on 12 of 12"
    ):
        run_suite(ScriptedEngine(), TOKENIZER, suite_for(tmp_path, reward="test_eval_raises"), seed=5)
