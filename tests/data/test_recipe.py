"""The SAF DeepMath recipe (configs/recipes/): its config passes ``train --dry-run`` on small generated files in
verl's, slime's and this project's layouts (every row checked, counts per source, the length filter), and its
tiny CPU variant trains a few RL steps end to end (chat template, SAF with a teacher, samples.jsonl)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sapo_megatron.cli import main
from sapo_megatron.data.tokenizer import load_tokenizer
from sapo_megatron.model.tiny import make_tiny_hf_checkpoint
from tests.data.chat_fixtures import (
    make_chat_tokenizer,
    plain_records,
    slime_records,
    verl_records,
    write_jsonl,
    write_verl_parquet,
)

pytest.importorskip("pyarrow")
REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "recipes" / "saf_deepmath_qwen3_4b.yaml"
TINY = REPO / "configs" / "recipes" / "saf_deepmath_tiny_cpu.yaml"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recipe")
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = verl_records(30)
    records.append({**records[0], "prompt": [{"role": "user", "content": "x " * 2100}]})  # over 2048 tokens
    pq.write_table(pa.Table.from_pylist(records), root / "train.parquet")
    init = root / "megatron_init"
    init.mkdir()
    return {
        "verl": root / "train.parquet",
        "heldout": write_verl_parquet(root / "aime.parquet", 4, sources=("aime24",)),
        "slime": write_jsonl(root / "slime.jsonl", slime_records(5)),
        "plain": write_jsonl(root / "plain.jsonl", plain_records(5)),
        "tokenizer": make_chat_tokenizer(root / "tokenizer"),
        "init": init,
    }


@pytest.mark.parametrize("layout", ["verl", "slime", "plain"])
def test_recipe_dry_run_checks_every_row(files, layout, capsys):
    keys = {"slime": ["data.format=slime", "data.prompt_key=question", "data.label_key=answer"]}
    sets = [
        f"data.train={files[layout]}",
        # one eval dataset; its keys are the train set's
        f"eval.datasets=[{{name: aime24, path: {files['slime' if layout == 'slime' else 'heldout']}}}]",
        f"data.tokenizer={files['tokenizer']}",
        f"model.init_path={files['init']}",
        *keys.get(layout, []),
    ]
    assert main(["train", str(RECIPE), "--dry-run", *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert "inputs OK" in out and "data OK: every row of the prompt data is usable" in out
    expected = {
        "verl": (
            "30 prompts, 1 filtered",
            "format verl (auto: it has reward_model.ground_truth and data_source)",
        ),
        "slime": ("5 prompts", "format slime (data.format)"),
        "plain": ("5 prompts", "format plain (auto: it has prompt and ground_truth)"),
    }[layout]
    for text in expected:
        assert text in out, out
    per_source = {"verl": "31 rows in", "slime": "per source: -: 5", "plain": "addition: 5"}
    assert per_source[layout] in out
    assert "read and checked every row's schema in" in out
    assert ("aime24: 4" in out) == (layout != "slime")  # the verl eval file, read by auto


def test_recipe_dry_run_names_a_bad_row(files, tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [*slime_records(2), {"question": "q"}])
    sets = [f"data.train={bad}", f"data.tokenizer={files['tokenizer']}", f"model.init_path={files['init']}"]
    sets += ["eval.datasets=[]", "data.prompt_key=question", "data.label_key=answer"]
    assert main(["train", str(RECIPE), "--dry-run", *[a for s in sets for a in ("--set", s)]]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:3: missing field 'answer' (data.label_key; the row has: question)" in err


def test_tiny_cpu_variant_trains(files, tmp_path):
    teacher = make_tiny_hf_checkpoint(
        tmp_path / "teacher", "dense", seed=5, vocab_size=384, max_position_embeddings=128
    )
    make_chat_tokenizer(teacher)
    cfg = yaml.safe_load(TINY.read_text())
    cfg["output_dir"] = str(tmp_path / "run")
    cfg["data"].update(train=str(files["verl"]), tokenizer=str(files["tokenizer"]))
    cfg["eval"]["datasets"][0]["path"] = str(files["heldout"])
    cfg["teachers"][0]["model_path"] = str(teacher)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "sapo_megatron.cli", "train", str(config)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "30 prompts, 1 filtered" in proc.stdout  # the 2100-word prompt, over data.max_prompt_tokens=64
    run = tmp_path / "run"
    rl = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3] and all("saf/multiplier" in r for r in rl)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4 + [3] * 4
    tokenizer = load_tokenizer(str(files["tokenizer"]))
    chat_prompts = {
        tokenizer.decode(
            tokenizer.hf.apply_chat_template(
                r["prompt"],
                add_generation_prompt=True,
                enable_thinking=False,
                tokenize=True,
                return_dict=False,
            ),
            skip_special_tokens=False,
        )
        for r in verl_records(30)
    }
    assert all(
        s["prompt"] in chat_prompts for s in samples
    )  # what the engine received, chat template applied
    assert {s["source"] for s in samples} <= {"deepmath", "aime"}
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
