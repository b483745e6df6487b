"""Warnings where a run learns nothing (issue 29, frictions 4 and 5): SFT targets that the reward never scores are
named before the warm start, with the row field that would score; RL steps whose groups all have equal rewards
give one warning with the likely causes."""

from __future__ import annotations

import json
import logging

import pytest

from sapo_megatron.config import config_from_dict
from sapo_megatron.data.datasets import DatasetKeys, read_dataset
from sapo_megatron.defaults import embedded_default_dict
from sapo_megatron.loop.learning_signal import PATIENCE, NoSignalWatch, check_sft_targets
from sapo_megatron.rewards.runner import build_reward_runner
from tests.data.chat_fixtures import write_jsonl

VERL_GSM8K = """
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    found = re.findall(r"#### (\\-?[0-9\\.\\,]+)", solution_str)
    return 1.0 if found and found[-1].replace(",", "") == ground_truth else 0.0
"""


@pytest.fixture
def gsm8k(tmp_path):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"Tom has {a} apples and buys 5. How many?"}],
            "reward_model": {"style": "rule", "ground_truth": str(a + 5)},
            "extra_info": {"index": a, "answer": f"{a} + 5 = {a + 5}\n#### {a + 5}"},
        }
        for a in range(4)
    ]
    (tmp_path / "reward.py").write_text(VERL_GSM8K)
    runner = build_reward_runner(f"{tmp_path}/reward.py:compute_score", workers=0)
    yield write_jsonl(tmp_path / "gsm8k.jsonl", rows), runner
    runner.close()


def test_sft_targets_that_never_score_are_named_with_the_field_that_does(gsm8k, caplog):
    """Friction 4: the bare label '9' never scores under a verl GSM8K reward; extra_info.answer does."""
    path, runner = gsm8k
    rows = read_dataset(path, DatasetKeys()).rows
    with caplog.at_level(logging.WARNING):
        message = check_sft_targets(runner, rows, response_key=None)
    assert message is not None and message in caplog.text
    assert "none of the first 4 SFT targets (the label (no data.response_key); e.g. '5')" in message
    assert "these row fields do score: extra_info.answer" in message
    fixed = read_dataset(path, DatasetKeys(response_key="extra_info.answer")).rows
    assert check_sft_targets(runner, fixed, response_key="extra_info.answer") is None


def test_equal_rewards_in_every_group_warn_once_with_the_causes(caplog):
    """Friction 5: zero reward spread in every group for a few steps: one warning, not one per step."""
    watch = NoSignalWatch(config_from_dict(embedded_default_dict()))
    flat = {"reward/group_std_mean": 0.0, "reward/mean": 0.0, "response/truncated_frac": 0.5}
    learning = {**flat, "reward/group_std_mean": 0.3}
    with caplog.at_level(logging.WARNING):
        said = [watch.observe(step, m) for step, m in enumerate([flat, flat, learning, *[flat] * 6], start=1)]
    assert [i for i, m in enumerate(said, start=1) if m] == [
        3 + PATIENCE
    ]  # the spread at step 3 reset the count
    message = said[3 + PATIENCE - 1]
    assert message.startswith(f"no reward signal: in the last {PATIENCE} RL steps (to step {3 + PATIENCE})")
    for cause in (
        "data.response_key",
        "data.label_key",
        "rollout.max_new_tokens=6 too short (50% of the last",
    ):
        assert cause in message
    assert caplog.text.count("no reward signal") == 1


def test_the_dry_run_checks_the_sft_targets_too(gsm8k, tmp_path, capsys):
    """Fails on 3855bb6: ``train --dry-run`` said nothing, and the TRL user spent 60 SFT steps on targets the
    reward never scored; ``train`` checked them only after the session started."""
    from sapo_megatron.cli import main

    path, _ = gsm8k
    config = {
        "model": {"hf_config": "tiny"},
        "data": {"train": str(path), "tokenizer": "chat"},
        "algorithm": {"reward": f"{tmp_path}/reward.py:compute_score"},
        "sft": {"steps": 60},
    }
    (tmp_path / "run.yaml").write_text(json.dumps(config))
    assert main(["train", str(tmp_path / "run.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (
        "warning: none of the first 4 SFT targets" in out
        and "these row fields do score: extra_info.answer" in out
    )
    assert "data OK" in out
    config["data"]["response_key"] = "extra_info.answer"
    (tmp_path / "run.yaml").write_text(json.dumps(config))
    assert main(["train", str(tmp_path / "run.yaml"), "--dry-run"]) == 0
    assert "sft targets OK: they score under algorithm.reward" in capsys.readouterr().out
