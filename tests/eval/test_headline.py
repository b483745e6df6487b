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
