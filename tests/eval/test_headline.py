"""Eval's "accuracy" only for a 0/1 reward (issue 38, item 4: the TRL user's weighted reward, 0 to 1.5, was
reported as accuracy)."""

from __future__ import annotations

import types

from sapo_megatron.eval.metrics import ScoredSample, dataset_metrics, flat_metrics, headline_name
from sapo_megatron.loop import evaluation


def _metrics(scores: list[float]) -> dict:
    return dataset_metrics([[ScoredSample(s) for s in scores]], [None])


def test_the_headline_is_named_for_what_it_is(monkeypatch):
    """Fails on 3855bb6: the RL row said ``accuracy`` 1.25 for a weighted reward's mean."""
    binary, graded = _metrics([1.0, 0.0]), _metrics([1.5, 1.0])
    assert (binary["scores"], graded["scores"]) == ("0/1", "graded")
    assert (headline_name(binary), headline_name(graded)) == ("accuracy", "eval_score")
    assert "eval/d/scores" not in flat_metrics("d", graded)  # a label, not a scalar
    for metrics, key in ((binary, "accuracy"), (graded, "eval_score")):
        monkeypatch.setattr(evaluation, "_run_on_main", lambda session, step, m=metrics: {"d": m})
        session = types.SimpleNamespace(
            cfg=types.SimpleNamespace(
                eval=types.SimpleNamespace(every=1), trainer=types.SimpleNamespace(steps=2)
            ),
            eval_suite=types.SimpleNamespace(datasets=["d"]),
            info=types.SimpleNamespace(is_main=True),
            tracker=types.SimpleNamespace(log=lambda *a, **k: None, message=lambda line: None),
        )
        state = types.SimpleNamespace(step=1, eval_last=None, eval_before=None)
        assert evaluation.evaluate(session, state, "step") == {key: metrics["avg@2"]}


def test_maj_at_n_counts_a_prompt_without_answers_as_0_and_never_beats_pass_at_n():
    """Fails on 3855bb6: maj@n averaged only the prompts that had an answer (the VL user's maj@4 0.2059 above its
    own pass@4 0.0625), while docs/evaluation.md says a prompt with no answer scores 0."""
    import random

    answered = [
        ScoredSample(1.0, "7"),
        ScoredSample(0.0, "8"),
        ScoredSample(1.0, "7"),
        ScoredSample(0.0, None),
    ]
    silent = [ScoredSample(0.0, None)] * 4
    metrics = dataset_metrics([answered, silent, silent, silent], [None] * 4)
    assert metrics["maj@4"] == 0.25 and metrics["pass@4"] == 0.25
    rng = random.Random(0)
    for _ in range(200):
        prompts = [
            [ScoredSample(float(rng.random() < 0.3), rng.choice(["1", "2", None, None])) for _ in range(4)]
            for _ in range(rng.randint(1, 6))
        ]
        metrics = dataset_metrics(prompts, [None] * len(prompts))
        assert metrics.get("maj@4", 0.0) <= metrics["pass@4"] + 1e-12


def test_a_warning_when_most_responses_hit_the_token_limit(caplog):
    """Fails on 3855bb6: 99 % of the VL user's responses ran to the limit and were scored without a word."""
    import logging

    from sapo_megatron.eval import runner

    dataset = types.SimpleNamespace(name="geo", max_new_tokens=64)
    cut = [[ScoredSample(0.0, truncated=True)] * 3 + [ScoredSample(1.0)]]
    with caplog.at_level(logging.WARNING, logger="sapo_megatron.eval.runner"):
        line = runner.note_truncation(dataset, dataset_metrics(cut, [None]))
        assert runner.note_truncation(
            dataset, dataset_metrics([[ScoredSample(0.0, truncated=True)] * 2], [None])
        )
        assert runner.note_truncation(dataset, dataset_metrics([[ScoredSample(1.0)] * 2], [None])) is None
    assert line.startswith("eval dataset geo: 75% of the responses hit max_new_tokens=64")
    assert caplog.records[0].getMessage() == line


def test_the_run_s_closing_line_names_the_headline_as_eval_json_does():
    """Found re-timing the TRL user's path: with a weighted reward the run still closed with "accuracy 0.469 ->
    0.484" though its eval.json said ``scores: graded``. Fails before this test."""
    from sapo_megatron.loop.trainer import _headline_word

    graded = {"eval": {"datasets": {"test": _metrics([1.5, 0.5]), "other": _metrics([1.0, 0.0])}}}
    assert _headline_word(graded) == "eval_score"
    assert _headline_word({"eval": {"datasets": {"test": _metrics([1.0, 0.0])}}}) == "accuracy"
    assert _headline_word({"eval_before": {"datasets": {"t": _metrics([0.5, 0.0])}}}) == "eval_score"
    assert _headline_word({}) == "accuracy"  # no evaluation: the word the summary's keys use
