"""Round 2 of the newcomer's path, rewards (issue 38, item 4): what a TRL user's reward file needs."""

from __future__ import annotations

import sys

from sapo_megatron.rewards.runner import build_reward_runner
from sapo_megatron.rewards.types import RewardInput


def test_a_reward_file_imports_the_modules_next_to_it(tmp_path, monkeypatch):
    """Fails on 3855bb6: ``ModuleNotFoundError: No module named 'my_helpers'`` unless PYTHONPATH named the folder.
    Inline and in a worker process alike, from another working directory."""
    folder = tmp_path / "rewards"
    folder.mkdir()
    (folder / "my_helpers.py").write_text("def norm(text):\n    return text.strip().lower()\n")
    (folder / "score.py").write_text(
        "from my_helpers import norm\n\ndef score(response, label, **kwargs):\n"
        "    return float(norm(response) == norm(label))\n"
    )
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader adds the folder; undone after the test
    inputs = [RewardInput(response=" Paris ", label="paris"), RewardInput(response="Rome", label="paris")]
    for workers in (0, 1):
        with build_reward_runner(f"{folder / 'score.py'}:score", workers=workers) as runner:
            assert [out.score for out in runner.score(inputs)] == [1.0, 0.0], workers
            assert runner.errors == 0


def test_dict_returns_of_a_trl_reward_work_as_documented(tmp_path):
    """docs/rewards.md said TRL rewards return numbers; dicts with ``score`` work and the docs say so now."""
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "rewards.md").read_text()
    assert "a dict with `score` and other fields, as every reward shape here may return" in docs
    (tmp_path / "trl_dict.py").write_text(
        "def fn(prompts, completions, **kwargs):\n"
        "    return [{'score': float('7' in c), 'answer': c[-1:]} for c in completions]\n"
    )
    inputs = [
        RewardInput(response="it is 7", label="7", group_id=0),
        RewardInput(response="8", label="7", group_id=0),
    ]
    with build_reward_runner(f"{tmp_path / 'trl_dict.py'}:fn", workers=0) as runner:
        outputs = runner.score(inputs)
    assert [(o.score, o.fields.get("answer")) for o in outputs] == [(1.0, "7"), (0.0, "8")]


def test_a_weighted_list_of_rewards_with_per_function_metrics(tmp_path):
    """Fails on 3855bb6 (a list was no reward spec): TRL's ``reward_funcs=[correct, fmt]`` with
    ``reward_weights=[1.0, 0.5]`` is ``algorithm.reward: [correct, {reward: fmt, weight: 0.5}]``; the score is the
    weighted sum (``(rewards_per_func * reward_weights).nansum(dim=1)``), each function's
    score is a field of the sample and its step mean a metric, as TRL logs ``rewards/<name>/mean``."""
    import pytest

    from sapo_megatron.config import ConfigError, config_from_dict
    from sapo_megatron.defaults import embedded_default_dict

    (tmp_path / "fmt.py").write_text(
        "def fmt(prompts, completions, **kwargs):\n"
        "    return [float(c.startswith('The answer')) for c in completions]\n"
    )
    raw = embedded_default_dict()
    raw["algorithm"] = {"reward": ["numeric_match", {"reward": f"{tmp_path / 'fmt.py'}:fmt", "weight": 0.5}]}
    cfg = config_from_dict(raw)
    responses = ["The answer is 12", "12", "The answer is 13", ""]
    inputs = [RewardInput(response=r, label="12", group_id=0) for r in responses]
    with build_reward_runner(cfg.algorithm.reward) as runner:
        outputs = runner.score(inputs)
        metrics = runner.take_step_metrics()
    assert [o.score for o in outputs] == [1.5, 1.0, 0.5, 0.0]
    assert [(o.fields["numeric_match"], o.fields["fmt"]) for o in outputs] == [(1, 1), (1, 0), (0, 1), (0, 0)]
    assert (metrics["reward/numeric_match/mean"], metrics["reward/fmt/mean"]) == (0.5, 0.5)
    assert runner.name == "1×numeric_match + 0.5×fmt"
    raw["algorithm"]["reward_kwargs"] = {"mode": "x"}
    with pytest.raises(ConfigError, match="give each entry its own"):
        config_from_dict(raw)
    raw["algorithm"] = {"reward": ["numeric_match", "no_such_reward"]}
    with pytest.raises(ConfigError, match=r"algorithm\.reward\[1\]"):
        build_reward_runner(config_from_dict(raw).algorithm.reward)


def test_a_weighted_reward_list_reads_as_a_sum_in_messages():
    """The dry run's eval line printed the list's Python repr (``[..., WeightedReward(reward=..., weight=0.5,
    name=None, kwargs={})]``; found re-timing the TRL user's path); it reads as the sum now."""
    from sapo_megatron.algo.config import AlgorithmConfig, reward_label

    algo = AlgorithmConfig.model_validate(
        {
            "reward": [
                "r.py:accuracy",
                {"reward": "r.py:fmt", "weight": 0.5},
                {"reward": {"url": "http://h:1"}},
            ]
        }
    )
    assert reward_label(algo.reward) == "r.py:accuracy + 0.5 × r.py:fmt + http://h:1"
    assert reward_label("numeric_match") == "numeric_match"
