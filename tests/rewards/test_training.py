"""A user's reward file drives a real (tiny) training run through the worker pool: the trainer scores each
round in one call (from the async rollout thread), the held-out evaluation scores with its own runner of the same
reward (counted apart from training), and the reward never sees torch."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from sapo_megatron.data.prompts import PromptRow, save_jsonl
from sapo_megatron.loop.learning_signal import TARGETS_SCORED
from tests.rl.test_trainer import PROBLEMS, metrics, train, write_config

REWARD = """
import json, os, sys

def reward(response, label, prompt, source):
    digits = response.split("=")[-1].strip()
    with open(os.environ["REWARD_LOG"], "a") as log:
        log.write(json.dumps({"pid": os.getpid(), "torch": "torch" in sys.modules, "prompt": prompt,
                              "source": source}) + "\\n")
    return {"score": float(digits == label), "answer": digits}
"""


def test_custom_reward_file_in_the_pool_trains(tmp_path, monkeypatch):
    rows = [PromptRow(prompt=f"{a}+{b}=", ground_truth=str(a + b), domain="add") for a, b in PROBLEMS]
    data = {
        "train": str(save_jsonl(rows * 4, tmp_path / "train.jsonl")),
        "heldout": str(save_jsonl(rows, tmp_path / "heldout.jsonl")),
    }
    (tmp_path / "my_reward.py").write_text(REWARD)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("REWARD_LOG", str(log))
    config = write_config(
        tmp_path / "run.yaml",
        data,
        **{
            "sft.steps": 5,
            "trainer.steps": 2,
            "trainer.prompts_per_step": 4,
            "algorithm.reward": f"{tmp_path}/my_reward.py:reward",
            "algorithm.reward_workers": 1,
            "algorithm.reward_timeout_s": 20,
            "trainer.rollout_mode": "one_step_off",  # the pool is driven from the rollout thread, evaluation from the main one
        },
    )
    train(config)
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_errors"] == 0 and summary["accuracy_after"] is not None
    rl = metrics(run_dir, "rl")
    assert len(rl) == 2 and all(row["reward/error_frac"] == 0.0 and row["time/reward_s"] > 0 for row in rl)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    n = yaml_n(config)
    sft_check = min(TARGETS_SCORED, 4 * len(rows))  # the SFT targets scored once before the warm start
    assert len(calls) == 2 * 4 * n + 2 * len(rows) + sft_check  # two RL steps, held-out before and after
    assert not any(c["torch"] for c in calls) and {c["source"] for c in calls} == {"add"}
    assert {c["prompt"] for c in calls} >= {row.prompt for row in rows}  # the decoded prompt ids
    assert len({c["pid"] for c in calls}) == 2  # one worker for training, one for evaluation, never restarted


def yaml_n(config: Path) -> int:
    return yaml.safe_load(config.read_text())["rollout"]["n_samples"]
