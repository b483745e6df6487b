"""Input files are checked before a run starts: every missing one is named with its config field."""

from __future__ import annotations

import json

import pytest

from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.loop.inputs import check_input_files
from sapo_megatron.model.tiny import tiny_hf_config


def config(**sections):
    return config_from_dict({"model": {"hf_config": tiny_hf_config()}, **sections})


def test_synthetic_data_and_char_tokenizer_need_no_files():
    check_input_files(config())


def test_every_missing_input_is_listed_with_its_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config(
        data={"train": "data/train.jsonl", "tokenizer": "tok"},
        eval={"datasets": [{"name": "heldout", "path": str(tmp_path / "heldout.jsonl")}]},
        model={"hf_config": tiny_hf_config(), "init": "megatron", "init_path": str(tmp_path / "ckpt")},
    )
    with pytest.raises(ConfigError) as err:
        check_input_files(cfg)
    assert str(err.value).splitlines() == [
        "missing input files:",
        f"  - data.train: data/train.jsonl does not exist (relative to the current directory {tmp_path})",
        f"  - eval.datasets[0].path: {tmp_path / 'heldout.jsonl'} does not exist",
        f"  - data.tokenizer: tok does not exist (relative to the current directory {tmp_path})",
        f"  - model.init_path: {tmp_path / 'ckpt'} does not exist",
    ]


def test_present_inputs_pass_and_wrong_kinds_are_named(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "ground_truth": "2"}\n')
    (tmp_path / "tok").mkdir()
    good = config(data={"train": str(tmp_path / "train.jsonl"), "tokenizer": str(tmp_path / "tok")})
    check_input_files(good)
    swapped = config(data={"train": str(tmp_path / "tok"), "tokenizer": str(tmp_path / "train.jsonl")})
    with pytest.raises(ConfigError) as err:
        check_input_files(swapped)
    message = str(err.value)
    assert f"data.train: {tmp_path / 'tok'} is not a file" in message
    assert f"data.tokenizer: {tmp_path / 'train.jsonl'} is not a directory" in message
    assert "eval.datasets" not in message  # no eval datasets


def test_hf_config_path_and_endpoints_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    cfg = config(
        model={"hf_config": str(tmp_path / "config.json")},
        rollout={"engine": "sglang", "endpoints_file": str(tmp_path / "endpoints.json")},
    )
    check_input_files(cfg)  # the endpoints file is written later, by the rollout job: not an input yet
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match=f"model.hf_config: {tmp_path / 'config.json'} does not exist"):
        check_input_files(cfg)


def test_a_dataset_may_be_a_directory_or_a_glob_of_shards(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "train-00000.parquet").write_bytes(b"")
    for train in (str(shards), str(shards / "train-*.parquet")):
        check_input_files(config(data={"train": train}))
    with pytest.raises(ConfigError, match=r"data\.train: .*/nothing-\*\.parquet matches no file"):
        check_input_files(config(data={"train": str(shards / "nothing-*.parquet")}))
