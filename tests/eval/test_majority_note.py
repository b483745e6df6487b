"""A reward that gives no answer to vote on (a float, as verl's compute_score returns) says why maj@n is missing
(issue 29, friction 7), once per dataset and reward."""

from __future__ import annotations

import logging

from sapo_megatron.data.datasets import DatasetKeys
from sapo_megatron.eval.config import EvalDataset
from sapo_megatron.eval.metrics import ScoredSample, dataset_metrics
from sapo_megatron.eval.runner import note_missing_majority


def _dataset(name: str, n: int) -> EvalDataset:
    return EvalDataset(
        name=name, path="x.jsonl", n=n, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=8,
        reward="r.py:compute_score", size=None, keys=DatasetKeys(),
    )  # fmt: skip


def test_missing_maj_is_explained_once(caplog):
    floats = dataset_metrics([[ScoredSample(1.0, None, 3, False), ScoredSample(0.0, None, 3, False)]], [None])
    assert "maj@2" not in floats
    with caplog.at_level(logging.WARNING):
        line = note_missing_majority(_dataset("gsm8k-floats", 2), floats)
        assert note_missing_majority(_dataset("gsm8k-floats", 2), floats) is None  # once
    assert line is not None and line in caplog.text
    assert "no maj@2: the reward r.py:compute_score gave no answer to vote on" in line
    voted = dataset_metrics([[ScoredSample(1.0, "7", 3, False), ScoredSample(0.0, "8", 3, False)]], [None])
    assert note_missing_majority(_dataset("gsm8k-answers", 2), voted) is None  # maj@2 is there
    assert note_missing_majority(_dataset("greedy", 1), floats) is None  # n 1: no vote expected
