"""``compare --runs`` of runs trained or evaluated differently (issue 38, item 4: the TRL user's two runs)."""

from __future__ import annotations

import json

import yaml

from sapo_megatron.compare.finished import report_finished_runs


def _run(path, *, reward: str, replay: str, eval_reward: str | None = None):
    path.mkdir(parents=True)
    rows = [{"phase": "rl", "step": s, "reward/mean": 0.5 + s / 10, "entropy": 1.0} for s in (1, 2, 3)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {"algorithm": {"reward": reward, "routing_replay": replay, "loss": {"name": "grpo"}}}
    if eval_reward:
        config["eval"] = {"datasets": [{"name": "h", "path": "synthetic:addition", "reward": eval_reward}]}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def test_runs_with_other_rewards_are_flagged_and_only_replay_arms_listed_under_replay(tmp_path, caplog):
    """Fails on 3855bb6: no word about the rewards, and arms with ``routing_replay: none`` were listed as "arms
    with routing replay that logged no routing/agreement_used"."""
    a = _run(tmp_path / "a", reward="numeric_match", replay="none")
    b = _run(tmp_path / "b", reward="rewards/weighted.py:score", replay="none")
    report = report_finished_runs([str(a), str(b)], tmp_path / "out").markdown.read_text()
    assert (
        "Warning: these runs used different rewards** (`a-s0`: numeric_match; `b-s0`: rewards/weighted.py:score)"
        in report
    )
    assert "used different rewards" in caplog.text
    assert "Arms with routing replay" not in report
    arms = json.loads((tmp_path / "out" / "report.json").read_text())["arms"]
    assert [(arm["loss"], arm["replay"]) for arm in arms] == [("grpo", "none"), ("grpo", "none")]

    c = _run(tmp_path / "c", reward="numeric_match", replay="r3")
    d = _run(tmp_path / "d", reward="numeric_match", replay="none", eval_reward="numeric_match")
    report = report_finished_runs([str(c), str(d)], tmp_path / "out2").markdown.read_text()
    assert "different rewards" not in report  # the same reward, trained and evaluated
    assert (
        "Arms with routing replay that logged no `routing/agreement_used`, so nothing shows the replay acted: `c-s0`."
        in report
    )
