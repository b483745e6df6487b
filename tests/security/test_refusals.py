"""Inputs that used to be accepted silently or hang (issue 20, Why 4 and 6): refused with one line naming the
file / field and the fix, before any work starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from sapo_megatron.cli import main
from sapo_megatron.config import ConfigError, config_from_dict, load_config
from sapo_megatron.model.tiny import tiny_hf_config
from sapo_megatron.plan.gate import LayoutDoesNotFit, check_layout_fits

QWEN30B = Path(__file__).resolve().parents[2] / "configs" / "qwen3_30b_a3b_sapo_h100.yaml"


def tiny(**sections):
    return config_from_dict({"model": {"hf_config": tiny_hf_config("moe")}, **sections})


def test_config_files_that_are_not_yaml_mappings_name_the_problem(tmp_path):
    cases = {
        "dup.yaml": (
            b"trainer:\n  steps: 3\nrollout:\n  n_samples: 2\ntrainer:\n  steps: 9\n",
            "key 'trainer' appears twice (lines 1 and 5)",
        ),
        "dup_inner.yaml": (
            b"trainer:\n  steps: 3\n  steps: 4\n",
            "key 'steps' appears twice (lines 2 and 3)",
        ),
        "latin1.yaml": ("name: caf\xe9\n".encode("latin-1"), "is not UTF-8 text (byte 9"),
    }
    for name, (data, words) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            load_config(tmp_path / name)
    with pytest.raises(ConfigError, match="is a directory: give the YAML file in it"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    ("sections", "words"),
    [
        ({"rollout": {"temperature": float("inf")}}, "rollout.temperature"),
        ({"rollout": {"temperature": float("nan")}}, "rollout.temperature"),
        ({"optimizer": {"lr": float("inf")}}, "optimizer.lr"),
        ({"trainer": {"prompts_per_step": 10**12}}, "less than or equal to 1000000"),
        ({"rollout": {"n_samples": 10**6}}, "less than or equal to 4096"),
        ({"rollout": {"max_new_tokens": 10**9}}, "less than or equal to 10000000"),
        (
            {"trainer": {"prompts_per_step": 1_000_000}, "rollout": {"n_samples": 4096}},
            "above the limit of 10000000",
        ),
    ],
)
def test_absurd_or_infinite_values_are_refused_naming_the_limit(sections, words):
    with pytest.raises(ConfigError) as caught:
        tiny(**sections)
    assert words in str(caught.value) + str(caught.value.hint or "")


def test_an_unfit_layout_fails_the_dry_run_and_train_unless_forced(capsys):
    assert main(["train", "--dry-run", "--world-size", "1"]) == 0  # the demo fits
    capsys.readouterr()
    assert main(["train", "--dry-run", "--world-size", "1", "--gpu-memory-gb", "0.001"]) == 1
    captured = capsys.readouterr()
    assert (
        "DOES NOT FIT" in captured.out and "error: the layout does not fit: pipeline stage 0" in captured.err
    )
    cfg = load_config(QWEN30B, {"launch.gpu_type": "l40s", "model.recompute": "none"})
    with pytest.raises(LayoutDoesNotFit, match="does not fit on l40s: pipeline stage 0 needs about"):
        check_layout_fits(cfg)
    check_layout_fits(cfg, force=True)
    assert "training anyway (--force)" in capsys.readouterr().out
    check_layout_fits(load_config(QWEN30B))  # the shipped layout fits its h100s
    check_layout_fits(tiny())  # no launch.gpu_type (CPU): nothing to check


def test_empty_prompts_and_numberless_labels_under_numeric_match_are_named(tmp_path, caplog):
    from sapo_megatron.data.datasets import DatasetKeys, load_dataset
    from sapo_megatron.data.prompts import DatasetError, PromptRow
    from sapo_megatron.rewards.registry import check_labels

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "  ", "ground_truth": "3"}\n')
    with pytest.raises(DatasetError, match=r"train.jsonl:2: field 'prompt' \(the prompt\) is empty"):
        load_dataset(data, DatasetKeys())

    rows = [PromptRow("a", "7"), PromptRow("b", "seven"), PromptRow("c", "x")]
    check_labels("exact_match", rows, "train.jsonl")  # not a numeric reward: nothing to say
    with caplog.at_level("WARNING"):
        check_labels("numeric_match", rows, "train.jsonl")
    assert "2 of 3 labels hold no number" in caplog.text and "row 1 ('seven')" in caplog.text
    with pytest.raises(ConfigError, match=r"no label of train\.jsonl holds one"):
        check_labels("numeric_match", rows[1:], "train.jsonl")
