"""The eval metrics against hand-computed values: unbiased pass@k, maj@n with its tie rule, per-source splits,
and the config section's resolution and refusals."""

from __future__ import annotations

from math import comb

import pytest

from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.eval.config import resolve_datasets
from sapo_megatron.eval.metrics import (
    ScoredSample,
    dataset_metrics,
    flat_metrics,
    k_values,
    majority_answer,
    pass_at_k,
    prompt_metrics,
)
from sapo_megatron.model.tiny import tiny_hf_config


def samples(scores, answers=None, lengths=None, truncated=None):
    n = len(scores)
    answers = answers or [None] * n
    lengths = lengths or [0] * n
    truncated = truncated or [False] * n
    return [ScoredSample(s, a, t, x) for s, a, t, x in zip(scores, answers, lengths, truncated)]


def test_pass_at_k_edges_and_hand_values():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 0, 8) == 0.0  # c = 0: never
    assert pass_at_k(8, 8, 1) == 1.0 and pass_at_k(8, 8, 4) == 1.0  # c = n: always
    assert pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 3, 8) == 1.0  # k = n: any correct sample
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # k = 1: the fraction correct
    # n = 4, c = 1, k = 2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n = 8, c = 2, k = 4: 1 - C(6,4)/C(8,4) = 1 - 15/70
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)
    for n, c, k in ((32, 5, 16), (32, 1, 2), (10, 7, 3)):
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), rel=1e-12)
    assert pass_at_k(5, 4, 2) == 1.0  # n - c < k
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    assert k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6] and k_values(1) == [1]


def test_k1_equals_avg_and_prompt_metrics():
    got = prompt_metrics(samples([1, 0, 1, 0], lengths=[3, 5, 2, 6], truncated=[False, True, False, False]))
    assert got["avg@4"] == 0.5 == got["pass@1"]
    assert got["pass@2"] == pytest.approx(1 - comb(2, 2) / comb(4, 2))  # 5/6
    assert got["pass@4"] == 1.0
    assert "maj@4" not in got  # the reward gave no answers
    assert got["response_length_mean"] == 4.0 and got["truncated_frac"] == 0.25
    # avg@n is the mean of the raw scores; pass@k counts scores above 0.5
    partial = prompt_metrics(samples([0.4, 1.0]))
    assert partial["avg@2"] == pytest.approx(0.7) and partial["pass@1"] == 0.5


def test_majority_vote_and_its_tie_rule():
    # "7" twice beats "5" once: the prompt scores what the first "7" scored
    assert prompt_metrics(samples([0, 1, 0], ["7", "5", "7"]))["maj@3"] == 0.0
    assert prompt_metrics(samples([1, 0, 1], ["7", "5", "7"]))["maj@3"] == 1.0
    # a tie (2 vs 2) goes to the answer seen first in sample order
    assert majority_answer(["5", "7", "7", "5"]) == 0
    assert majority_answer(["7", "5", "5", "7"]) == 0
    assert prompt_metrics(samples([0, 1, 1, 0], ["5", "7", "7", "5"]))["maj@4"] == 0.0
    assert prompt_metrics(samples([1, 0, 0, 1], ["5", "7", "7", "5"]))["maj@4"] == 1.0
    # samples without an answer do not vote; none at all: 0
    assert majority_answer([None, "3", None]) == 1
    assert majority_answer([None, None]) is None
    assert prompt_metrics(samples([1, 0, 0], [None, "3", "3"]))["maj@3"] == 0.0


def test_dataset_metrics_per_source_and_flat_names():
    prompts = [samples([1, 1], ["2", "2"]), samples([0, 0], ["4", "5"]), samples([1, 0], ["6", "7"])]
    got = dataset_metrics(prompts, ["math", "code", "math"])
    assert got["n"] == 2 and got["num_prompts"] == 3
    assert got["avg@2"] == pytest.approx(0.5)
    assert got["pass@2"] == pytest.approx(2 / 3)
    assert got["maj@2"] == pytest.approx((1 + 0 + 1) / 3)  # the third prompt's tie goes to "6" (score 1)
    assert got["by_source"]["math"] == {
        "num_prompts": 2,
        "avg@2": 0.75,
        "pass@1": 0.75,
        "pass@2": 1.0,
        "maj@2": 1.0,
        "response_length_mean": 0.0,
        "truncated_frac": 0.0,
    }
    assert got["by_source"]["code"]["avg@2"] == 0.0 and got["by_source"]["code"]["num_prompts"] == 1
    flat = flat_metrics("aime", got)
    assert flat["eval/aime/avg@2"] == pytest.approx(0.5) and flat["eval/aime/math/pass@2"] == 1.0
    assert "eval/aime/n" not in flat and not any("by_source" in key for key in flat)
    assert dataset_metrics(prompts, [None, None, None])["by_source"] == {}


def config(**sections):
    return config_from_dict({"model": {"hf_config": tiny_hf_config()}, **sections})


def test_eval_section_resolves_over_defaults_and_refuses_old_keys():
    cfg = config(
        rollout={"max_new_tokens": 7},
        eval={
            "defaults": {"n": 4, "temperature": 1.0, "top_p": 0.9},
            "datasets": [
                {"name": "a", "path": "a.jsonl"},
                {"name": "b", "path": "b.jsonl", "n": 1, "temperature": 0, "max_new_tokens": 3},
            ],
        },
    )
    a, b = resolve_datasets(cfg)
    assert (a.n, a.temperature, a.top_p, a.max_new_tokens, a.reward) == (4, 1.0, 0.9, 7, "numeric_match")
    assert (b.n, b.temperature, b.max_new_tokens) == (1, 0.0, 3)
    assert resolve_datasets(config()) == []  # no eval section: nothing evaluated
    with pytest.raises(ConfigError, match=r"n=8 at temperature 0 draws 8 identical greedy samples"):
        config(eval={"datasets": [{"name": "a", "path": "a.jsonl", "n": 8}]})
    with pytest.raises(ConfigError, match=r"the name 'a' is used twice"):
        config(eval={"datasets": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]})
    with pytest.raises(ConfigError, match=r"eval.datasets.0.name"):
        config(eval={"datasets": [{"name": "a/b", "path": "x"}]})
    with pytest.raises(ConfigError) as err:
        config(data={"heldout": "h.jsonl", "heldout_size": 50}, trainer={"eval_every": 10})
    assert str(err.value).splitlines() == [
        "data.heldout, data.heldout_size, trainer.eval_every: replaced by the eval section "
        "(docs/evaluation.md); write instead:",
        "eval:",
        "  every: 10",
        "  datasets:",
        "  - {name: heldout, path: h.jsonl, n: 1, temperature: 0, size: 50}",
    ]
    assert err.value.hint.startswith('--set \'eval.every=10\' --set \'eval.datasets=[{"name": "heldout"')
    with pytest.raises(ConfigError) as err:  # an old key --set over a config that has an eval section
        config(eval={"datasets": [{"name": "a", "path": "x"}]}, trainer={"eval_every": 5})
    assert str(err.value).splitlines()[1:] == ["eval: {every: 5}"]
