"""Evaluation metrics over ``n`` scored samples per prompt (pure Python / NumPy).

For one prompt with scores ``s_1 .. s_n`` of which ``c`` are correct (a sample is correct when its score exceeds
:data:`CORRECT_ABOVE`; the rewards here give 0 or 1):

- ``avg@n`` = mean of the n scores (the raw scores, not thresholded);
- ``pass@k`` = ``1 - C(n - c, k) / C(n, k)``, the unbiased estimator of "at least one of k samples is correct"
  (Chen et al. 2021, Codex paper, computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``); k = 1, 2, 4, ... up to n,
  and n itself; pass@1 equals avg@n for 0/1 scores;
- ``maj@n`` = the score of the majority answer: the answers the reward extracted are counted (samples without an
  answer do not vote), the most frequent wins, **a tie goes to the answer that appears first in sample order**
  (as ``collections.Counter.most_common``, which verl's and inspect's majority votes use), and the prompt scores
  what the first sample with that answer scored; a prompt whose samples gave no answer scores 0. Only when the
  reward gives answers (some sample has one);
- ``response_length_mean`` (tokens) and ``truncated_frac`` (share of samples that hit ``max_new_tokens``);
- ``thinking_share``: of the response tokens, the share inside ``<think>…</think>`` (when the reward scores
  after thinking, ``algorithm.reward_after_thinking``).

A dataset's value is the mean over its prompts; ``by_source`` repeats the prompt metrics per source; ``scores``
says whether every score was 0 or 1 (``"0/1"``: avg@n is an accuracy) or not (``"graded"``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

CORRECT_ABOVE = 0.5
"""A sample counts as correct for pass@k when its score is above this."""


@dataclasses.dataclass(frozen=True)
class ScoredSample:
    """What the metrics need of one sample."""

    score: float
    answer: str | None = None
    response_tokens: int = 0
    truncated: bool = False
    turns: int | None = None  # multi-turn episodes: engine turns and tool calls
    tool_calls: int | None = None
    thinking_tokens: int | None = None  # of response_tokens, inside <think>…</think> (thinking models)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: ``1 - C(n - c, k) / C(n, k)`` for ``c`` correct of ``n`` samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def k_values(n: int) -> list[int]:
    """The k of pass@k: powers of two up to n, and n."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else [*ks, n]


def majority_answer(answers: Sequence[str | None]) -> int | None:
    """Index of the first sample carrying the majority answer (ties: the answer seen first); None when no
    sample has an answer."""
    votes = Counter(answer for answer in answers if answer is not None)
    if not votes:
        return None
    winner = votes.most_common(1)[0][0]  # most_common keeps first-seen order among equal counts
    return answers.index(winner)


def prompt_metrics(samples: Sequence[ScoredSample]) -> dict[str, float]:
    """avg@n, pass@k, maj@n (when any sample has an answer), length and truncation of one prompt's samples."""
    n = len(samples)
    scores = [s.score for s in samples]
    correct = sum(score > CORRECT_ABOVE for score in scores)
    out = {f"avg@{n}": float(np.mean(scores))}
    out.update({f"pass@{k}": pass_at_k(n, correct, k) for k in k_values(n)})
    answers = [s.answer for s in samples]
    if any(answer is not None for answer in answers):
        winner = majority_answer(answers)
        out[f"maj@{n}"] = 0.0 if winner is None else float(scores[winner])
    out["response_length_mean"] = float(np.mean([s.response_tokens for s in samples]))
    out["truncated_frac"] = float(np.mean([s.truncated for s in samples]))
    if all(s.turns is not None for s in samples):  # evaluated with tools
        out["turns_mean"] = float(np.mean([s.turns for s in samples]))
        out["tool_calls_mean"] = float(np.mean([s.tool_calls for s in samples]))
    if all(s.thinking_tokens is not None for s in samples):
        total = sum(s.response_tokens for s in samples)
        out["thinking_share"] = sum(s.thinking_tokens or 0 for s in samples) / total if total else 0.0
    return out


def dataset_metrics(
    prompts: Sequence[Sequence[ScoredSample]], sources: Sequence[str | None]
) -> dict[str, Any]:
    """The dataset's metrics (means over its prompts) in the ``eval.json`` shape: ``n``, ``num_prompts``, the
    metrics of :func:`prompt_metrics`, and ``by_source`` (the same per source; prompts without one are only in
    the totals). When the reward gives answers, maj@n is averaged over every prompt, one without any answer
    scoring 0 (so maj@n <= pass@n for 0/1 scores)."""
    if not prompts:
        raise ValueError("dataset_metrics: no prompts")
    n = len(prompts[0])
    if any(len(p) != n for p in prompts):
        raise ValueError("dataset_metrics: every prompt needs the same number of samples")
    per_prompt = [prompt_metrics(p) for p in prompts]
    majority = f"maj@{n}"
    if any(majority in row for row in per_prompt):  # a prompt none of whose samples gave an answer scores 0
        for row in per_prompt:
            row.setdefault(majority, 0.0)
    binary = all(s.score in (0.0, 1.0) for p in prompts for s in p)
    by_source: dict[str, list[dict[str, float]]] = {}
    for source, values in zip(sources, per_prompt):
        if source is not None:
            by_source.setdefault(source, []).append(values)
    return {
        "n": n,
        "scores": "0/1" if binary else "graded",
        **_mean_over_prompts(per_prompt),
        "by_source": {source: _mean_over_prompts(rows) for source, rows in sorted(by_source.items())},
    }


def _mean_over_prompts(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = list(dict.fromkeys(key for row in rows for key in row))
    means = {key: float(np.mean([row[key] for row in rows if key in row])) for key in keys}
    return {"num_prompts": len(rows), **means}


def flat_metrics(name: str, metrics: dict[str, Any]) -> dict[str, float]:
    """The scalars to log of one dataset: ``eval/{name}/{metric}`` and ``eval/{name}/{source}/{metric}``."""
    out = {f"eval/{name}/{key}": float(value) for key, value in metrics.items() if _scalar(key, value)}
    for source, values in metrics.get("by_source", {}).items():
        out.update({f"eval/{name}/{source}/{k}": float(v) for k, v in values.items() if _scalar(k, v)})
    return out


def _scalar(key: str, value: Any) -> bool:
    return key not in ("n", "by_source") and isinstance(value, int | float) and not isinstance(value, bool)


def headline(metrics: dict[str, Any]) -> float:
    """A dataset's headline number: avg@n (greedy accuracy at n = 1)."""
    return float(metrics[f"avg@{metrics['n']}"])


def headline_name(metrics: dict[str, Any]) -> str:
    """What the headline is: ``accuracy`` when every score was 0 or 1, else ``eval_score`` (the mean of a graded
    reward, e.g. a weighted sum up to 1.5, is no accuracy)."""
    return "eval_score" if metrics.get("scores") == "graded" else "accuracy"
