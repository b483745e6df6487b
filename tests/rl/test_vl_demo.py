"""`make demo-vl` end to end on tiny sizes: the demo config as shipped, its data written by the demo's data step,
2 SFT steps, 2 SAPO steps and the held-out evaluation before and after (``--set`` overrides only). Whether the demo
learns is measured and reported (docs/multimodal.md), not asserted: that needs minutes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sapo_megatron.data.vl_demo import main as write_demo_inputs
from tests.rl.test_trainer import metrics, train

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_the_vl_demo_config_runs_end_to_end(tmp_path):
    data = tmp_path / "data"
    write_demo_inputs([str(data), "--train", "16", "--heldout", "4"])
    run = tmp_path / "run"
    train(
        REPO / "configs/demo_tiny_vl_moe_cpu.yaml",
        "--output-dir", str(run),
        "--set", f"data.train={data / 'train.jsonl'}",
        "--set", f"data.tokenizer={data / 'tokenizer'}",
        "--set", f"eval.datasets.0.path={data / 'heldout.jsonl'}",
        "--set", "eval.datasets.0.n=2",
        "--set", "eval.every=2",
        "--set", "sft.steps=2",
        "--set", "sft.global_batch=4",
        "--set", "sft.log_every=1",
        "--set", "trainer.steps=2",
        "--set", "trainer.prompts_per_step=4",
        "--set", "rollout.n_samples=2",
    )  # fmt: skip
    assert [row["step"] for row in metrics(run, "sft")] == [1, 2]
    rl = metrics(run, "rl")
    assert [row["step"] for row in rl] == [1, 2]
    assert all(row["mismatch/abs_delta_mean"] < 1e-5 for row in rl)  # the trainer saw the engine's pixels
    evals = metrics(run, "eval")
    assert [row["step"] for row in evals] == [0, 2]
    for row in evals:  # avg@2 on the 4 held-out images, overall and for the task's source
        assert row["eval/heldout/num_prompts"] == 4
        assert 0.0 <= row["eval/heldout/name_colour/avg@2"] == row["eval/heldout/avg@2"] <= 1.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["accuracy_before"] == evals[0]["eval/heldout/avg@2"]
    assert (run / "hf" / "preprocessor_config.json").is_file()  # the export is a VL model with its processor
    samples = [
        json.loads(line) for line in (run / "eval" / "step_000002" / "samples.jsonl").read_text().splitlines()
    ]
    assert len(samples) == 8 and all(s["source"] == "name_colour" for s in samples)

    # the run folder re-evaluates to its own last evaluation, response for response. Failed before the fused-expert
    # fix (issue 38: 1 of 192 identical): the demo's hidden 64 = expert size 64 made transformers load the export's
    # down_proj untransposed, while the run's engine had its weights by tensor sync
    from sapo_megatron.cli import main

    again = tmp_path / "again"
    assert main(["eval", "--model", str(run), "--output-dir", str(again)]) == 0
    rerun = [json.loads(line) for line in (again / "samples.jsonl").read_text().splitlines()]
    assert [s["response"] for s in rerun] == [s["response"] for s in samples]
    assert json.loads((again / "eval.json").read_text())["datasets"] == summary["eval"]["datasets"]
