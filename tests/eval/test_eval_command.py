"""`sapo-megatron eval` on one small trained run: its HF export, the run folder, its Megatron checkpoint and the
same weights served over HTTP give the same samples and numbers for the same seed; both output files in their
documented shapes; the run's own evaluation, summary and report; evaluation leaves the engine's seed stream alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sapo_megatron.cli import main
from sapo_megatron.data.prompts import PromptRow, save_jsonl
from tests.rl.test_trainer import train, write_config

PROBLEMS = [(47, 38, "a"), (59, 26, "a"), (68, 17, "b"), (29, 66, "b")]
METRIC_KEYS = ["avg@4", "pass@1", "pass@2", "pass@4", "maj@4", "response_length_mean", "truncated_frac"]
SAMPLE_KEYS = [
    "dataset", "index", "sample", "source", "prompt", "response", "score", "answer", "finish_reason",
    "response_tokens",
]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """40 SFT steps (the model half-learns 4 problems) and 2 RL steps, evaluated with n 4 at temperature 1."""
    root = tmp_path_factory.mktemp("evalrun")
    rows = [PromptRow(prompt=f"{a}+{b}=", ground_truth=str(a + b), domain=d) for a, b, d in PROBLEMS]
    heldout = str(save_jsonl(rows, root / "heldout.jsonl"))
    data = {"train": str(save_jsonl(rows * 8, root / "train.jsonl")), "heldout": heldout}
    config = write_config(
        root / "run.yaml",
        data,
        **{
            "trainer.steps": 2,
            "trainer.prompts_per_step": 4,
            "eval": {"every": 1, "datasets": [{"name": "sums", "path": heldout, "n": 4, "temperature": 1.0}]},
        },
    )
    train(config)
    return root / "run"


def evaluate(tmp_path: Path, name: str, *args: str) -> tuple[dict, list[dict]]:
    out = tmp_path / name
    assert main(["eval", *args, "--output-dir", str(out)]) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return json.loads((out / "eval.json").read_text()), samples


def test_hf_folder_run_folder_checkpoint_and_server_agree(run_dir, tmp_path, capsys):
    from tests.servers import cpu_server

    config = str(run_dir / "config.yaml")
    from_run, samples = evaluate(tmp_path, "run", "--model", str(run_dir))
    from_hf = evaluate(tmp_path, "hf", config, "--model", str(run_dir / "hf"))
    checkpoint = evaluate(tmp_path, "ckpt", "--model", str(run_dir / "checkpoints" / "step_000002"))
    with cpu_server(run_dir / "hf", tmp_path / "server.log") as url:
        served = evaluate(tmp_path, "served", config, "--urls", url)
        # the endpoints file the SLURM rollout job writes names the same server
        endpoints = tmp_path / "endpoints.json"
        endpoints.write_text(json.dumps({"router_url": None, "workers": [url]}))
        by_file = evaluate(tmp_path, "by_file", config, "--endpoints-file", str(endpoints))
    assert by_file[0]["model"] == str(endpoints)
    for other in (from_hf, checkpoint, served, by_file):
        assert other[0]["datasets"] == from_run["datasets"]
        assert other[1] == samples
    # eval.json: the documented shape; numbers that the samples reproduce
    assert from_run["model"] == str(run_dir) and from_run["seed"] == 1234
    sums = from_run["datasets"]["sums"]
    assert list(sums) == ["n", "scores", "num_prompts", *METRIC_KEYS, "by_source"]
    assert sums["scores"] == "0/1"  # numeric_match: avg@n is an accuracy
    assert (sums["n"], sums["num_prompts"]) == (4, 4)
    assert list(sums["by_source"]) == ["a", "b"]
    assert list(sums["by_source"]["a"]) == ["num_prompts", *METRIC_KEYS]
    assert sums["avg@4"] == pytest.approx(sum(s["score"] for s in samples) / 16)
    assert sums["by_source"]["b"]["avg@4"] == pytest.approx(
        sum(s["score"] for s in samples if s["source"] == "b") / 8
    )
    assert 0 < sums["avg@4"] < 1, "the half-trained model should get some samples right, not all"
    assert (
        sums["pass@1"] == pytest.approx(sums["avg@4"]) and sums["pass@4"] >= sums["pass@2"] >= sums["avg@4"]
    )
    # samples.jsonl: one row per sample, in the documented shape
    assert [list(s) for s in samples] == [SAMPLE_KEYS] * 16
    assert [(s["index"], s["sample"]) for s in samples] == [(i, j) for i in range(4) for j in range(4)]
    assert samples[0]["prompt"] == "47+38=" and samples[0]["dataset"] == "sums"
    right = [s for s in samples if s["score"] == 1.0]
    assert right and all(s["answer"] == str(sum(map(int, s["prompt"][:-1].split("+")))) for s in right)
    # the same seed in training: the last evaluation of the run is this one (same weights, same seeds)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval"]["step"] == 2 and summary["eval"]["datasets"] == from_run["datasets"]
    assert summary["accuracy_after"] == sums["avg@4"]
    # --n / --temperature / a different seed change the samples
    greedy, greedy_samples = evaluate(
        tmp_path, "greedy", "--model", str(run_dir), "--n", "1", "--temperature", "0"
    )
    assert greedy["datasets"]["sums"]["n"] == 1 and len(greedy_samples) == 4
    _, reseeded = evaluate(tmp_path, "seed", "--model", str(run_dir), "--seed", "7")
    assert [s["response"] for s in reseeded] != [s["response"] for s in samples]
    assert "samples/s" in capsys.readouterr().out


def test_the_run_logs_evaluations_and_writes_its_report(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if r["phase"] == "eval"}
    assert sorted(evals) == [0, 1, 2]  # before RL, and after each step (every: 1)
    for key in ("eval/sums/avg@4", "eval/sums/pass@4", "eval/sums/maj@4", "eval/sums/a/avg@4"):
        assert key in evals[2], key
    rl = {r["step"]: r for r in rows if r["phase"] == "rl"}
    assert rl[2]["accuracy"] == evals[2]["eval/sums/avg@4"]
    assert (run_dir / "eval" / "step_000002" / "samples.jsonl").is_file()
    assert list((run_dir / "tensorboard" / "eval").glob("events.out.tfevents.*"))
    report = (run_dir / "report" / "report.md").read_text()
    assert "| sums | 4 |" in report
    for stem in ("reward", "eval", "entropy", "response_length", "mismatch_k3", "grad_norm"):
        assert (run_dir / "report" / f"{stem}.png").stat().st_size > 1000, stem


def test_evaluation_draws_nothing_from_the_engine_seed_stream(run_dir):
    from sapo_megatron.config import load_config
    from sapo_megatron.data.tokenizer import load_tokenizer
    from sapo_megatron.eval.runner import build_suite, run_suite
    from sapo_megatron.rollout.cpu.engine import CPUEngine

    cfg = load_config(run_dir / "config.yaml", check_layout=False)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    suite = build_suite(cfg, tokenizer, seed=3)
    engine = CPUEngine.from_pretrained(run_dir / "hf", seed=0, num_threads=1)
    before = engine._seed_rng.bit_generator.state
    first = run_suite(engine, tokenizer, suite, seed=3)
    assert engine._seed_rng.bit_generator.state == before
    assert run_suite(engine, tokenizer, suite, seed=3).samples == first.samples
