"""Thinking-mode RL (issue 38, item 3): the reward scores the text after ``</think>`` (on by default for
``data.tokenizer: qwen3`` with thinking), a response cut while thinking has no answer, and eval reports the
thinking share of the response tokens. The split is SGLang's ``qwen3`` reasoning parser's."""

from __future__ import annotations

import pytest

from sapo_megatron.config import config_from_dict
from sapo_megatron.data.thinking import reward_after_thinking, split_thinking, thinking_tokens
from sapo_megatron.data.tokenizer import load_tokenizer
from sapo_megatron.eval.runner import build_suite, run_suite
from sapo_megatron.model.tiny import tiny_hf_config
from sapo_megatron.rollout.types import Sample

THOUGHT = "<think>\nMaybe 13? No: 5 + 7 = 12.\n</think>\n\nThe answer is 12"
CUT = "<think>\nIs it \\boxed{12}? Let me check"


def test_split_thinking_as_sglang_qwen3_reasoning_parser():
    assert split_thinking(THOUGHT) == ("\nMaybe 13? No: 5 + 7 = 12.\n", "\n\nThe answer is 12")
    assert split_thinking(CUT) == (CUT.removeprefix("<think>"), "")  # cut while thinking: no answer
    assert split_thinking("The answer is 12") == ("", "The answer is 12")  # thinking off: all answer
    assert split_thinking("no open</think> 12") == ("", "no open</think> 12")  # no <think>: not reasoning
    assert split_thinking("<think><think>a</think>b</think>c") == ("a", "b</think>c")  # the first close
    assert split_thinking("<think>\nplan\n<tool_call>\n{}") == ("\nplan\n", "<tool_call>\n{}")


def test_thinking_tokens_count_the_sampled_block_only():
    s, e = 100, 101
    assert thinking_tokens([s, 1, 2, e, 3, 4], s, e) == 4
    assert thinking_tokens([s, 1, 2], s, e) == 3  # cut before </think>
    assert thinking_tokens([1, 2, 3], s, e) == 0
    # an episode: turn 1 thinks (2 tokens + tags), the thinking-off style delta's empty block is not sampled
    ids = [s, 1, e, 2, 9, 9, s, e, 3]
    mask = [1, 1, 1, 1, 0, 0, 0, 0, 1]
    assert thinking_tokens(ids, s, e, mask) == 3


def _cfg(tmp_path, **overrides):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "5+7=", "ground_truth": "12", "domain": "x"}\n')
    raw = {
        "model": {"hf_config": tiny_hf_config(vocab_size=151936)},
        "data": {"tokenizer": "qwen3", **overrides.pop("data", {})},
        "rollout": {"max_new_tokens": 16},
        "algorithm": {"reward_workers": 0, **overrides.pop("algorithm", {})},
        "eval": {
            "datasets": [
                {"name": "d", "path": str(path), "n": 4, "temperature": 1.0, "reward": "numeric_match"}
            ]
        },
    }
    return config_from_dict(raw)


def test_on_by_default_for_qwen3_with_thinking_only(tmp_path):
    on = _cfg(tmp_path)
    assert reward_after_thinking(
        on.algorithm.reward_after_thinking, on.data.tokenizer, on.data.chat_template_kwargs
    )
    off = _cfg(tmp_path, data={"chat_template_kwargs": {"enable_thinking": False}})
    assert not reward_after_thinking(None, off.data.tokenizer, off.data.chat_template_kwargs)
    assert not reward_after_thinking(None, "chat", {})
    assert reward_after_thinking(True, "/models/Qwen3-4B", {})  # a model folder: set it


class ThinkingEngine:
    """Even samples think and answer 12; odd ones are cut by the token limit while thinking."""

    def __init__(self, hf) -> None:
        self.hf = hf

    def generate(self, requests):
        def sample(r, i):
            text = THOUGHT if i % 2 == 0 else CUT
            ids = list(self.hf(text, add_special_tokens=False)["input_ids"])
            return Sample(
                group_id=r.group_id,
                sample_index=i,
                prompt_ids=list(r.prompt_ids),
                response_ids=ids,
                rollout_logp=[0.0] * len(ids),
                finish_reason="stop" if i % 2 == 0 else "length",
            )

        return [[sample(r, i) for i in range(r.n)] for r in requests]


@pytest.mark.parametrize("after_thinking", [None, False])
def test_eval_scores_after_thinking_and_reports_its_share(tmp_path, after_thinking):
    """Fails on 3855bb6: the reward read the reasoning too, so a response cut while thinking scored 1 for the
    "12" it mentioned, and eval had no thinking share."""
    tokenizer = load_tokenizer("qwen3")
    cfg = _cfg(tmp_path, algorithm={"reward_after_thinking": after_thinking})
    suite = build_suite(cfg, tokenizer, seed=1)
    try:
        result = run_suite(ThinkingEngine(tokenizer.hf), tokenizer, suite, seed=1)
    finally:
        suite.close()
    d = result.metrics["d"]
    if after_thinking is False:  # the old behaviour: the number inside the cut thought counts
        assert d["avg@4"] == 1.0 and "thinking_share" not in d
        return
    assert d["avg@4"] == 0.5  # the cut responses have no answer
    thought = tokenizer.encode(THOUGHT)
    in_block = thought.index(151668) + 1  # through </think>
    cut = len(tokenizer.encode(CUT))
    assert d["thinking_share"] == pytest.approx((2 * in_block + 2 * cut) / (2 * len(thought) + 2 * cut))
    assert result.samples[0]["thinking_tokens"] == in_block and result.samples[1]["thinking_tokens"] == cut
    assert [s["answer"] for s in result.samples[:2]] == ["12", None]
