"""Hostile ``sapo-megatron eval`` and ``report`` command lines (issue 30, area "eval/report"), run in this
process. Every refusal comes before any model is loaded or converted, and eval never writes into a run's folder
or another command's outputs unless ``--overwrite`` says so."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from sapo_megatron.data.tokenizer import CharTokenizer
from sapo_megatron.model.tiny import make_tiny_hf_checkpoint
from sapo_megatron.rollout.cpu.server import CPUServer
from tests.rollout.conftest import engine_from
from tests.security.hostile import case, expect_cli

AREA = "eval/report"
ROWS = [{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "2+2=", "ground_truth": "4"}]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile_eval")
    moe_dir = make_tiny_hf_checkpoint(root / "tiny", vocab_size=CharTokenizer().vocab_size)
    data = root / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (root / "empty.jsonl").write_text("")
    config = root / "eval.yaml"
    settings = {"model": {"hf_config": str(moe_dir)}, "data": {"tokenizer": "char"}}
    config.write_text(yaml.safe_dump({**settings, "eval": {"defaults": {"max_new_tokens": 4}}}))
    run = (
        root / "run"
    )  # what a run's folder holds after some steps (eval reads nothing of it before refusing)
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(config.read_text())
    (run / "metrics.jsonl").write_text(json.dumps({"phase": "rl", "step": 1, "reward/mean": 0.5}) + "\n")
    (run / "samples.jsonl").write_text('{"step": 1, "response": "the run\'s own"}\n')
    (root / "bare_run").mkdir()
    (root / "bare_run" / "config.yaml").write_text(config.read_text())
    (root / "empty_dir").mkdir()
    (root / "a_file").write_text("x")
    return {"root": root, "data": data, "config": config, "run": run, "moe": moe_dir}


def argv(files: dict[str, Path], *args: str, out: str = "out") -> list[str]:
    """``eval`` on the tiny model with the char tokenizer and one small dataset; ``--model`` / ``--data`` in
    ``args`` replace those."""
    given = dict(zip(args[::2], args[1::2]))
    model = given.pop("--model", str(files["moe"]))
    data = given.pop("--data", f"sums={files['data']}")
    rest = [item for pair in given.items() for item in pair]
    return [
        "eval",
        str(files["config"]),
        "--model",
        model,
        "--data",
        data,
        *rest,
        "--output-dir",
        str(files["root"] / out),
    ]


@pytest.mark.parametrize(
    ("cls", "args", "words"),
    [
        case(AREA, "--model missing", "CLEAR", ["--model", "ROOT/nowhere"], "no such file or directory"),
        case(AREA, "--model empty dir", "CLEAR", ["--model", "ROOT/empty_dir"], "not an HF folder"),
        case(AREA, "run dir without checkpoint", "CLEAR", ["--model", "ROOT/bare_run"], "not an HF folder"),
        case(AREA, "--model is a file", "CLEAR", ["--model", "ROOT/a_file"], "not an HF folder"),
        case(AREA, "--n 0", "CLEAR", ["--n", "0"], "greater than or equal to 1"),
        case(AREA, "--n -5", "CLEAR", ["--n", "-5"], "greater than or equal to 1"),
        case(AREA, "--n 1e9 (greedy config)", "CLEAR", ["--n", "1000000000"], "less than or equal to 4096"),
        case(
            AREA,
            "--n 1e9 --temperature 1",
            "CLEAR",
            ["--n", "1000000000", "--temperature", "1"],
            "less than or equal to 4096",
        ),
        case(AREA, "--temperature -1", "CLEAR", ["--temperature", "-1"], "greater than or equal to 0"),
        case(AREA, "--temperature nan", "CLEAR", ["--temperature", "nan"], "temperature"),
        case(AREA, "--temperature 0 --n 4", "CLEAR", ["--temperature", "0", "--n", "4"], "identical greedy"),
        case(AREA, "0-row dataset", "CLEAR", ["--data", "sums=ROOT/empty.jsonl"], "empty.jsonl: no rows"),
    ],
)
def test_hostile_eval_arguments(files, capsys, cls, args, words):
    args = [a.replace("ROOT", str(files["root"])) for a in args]
    expect_cli(cls, argv(files, *args), capsys, words)
    assert not (files["root"] / "out" / "eval.json").exists()


def test_eval_into_a_run_folder_is_refused_and_the_run_kept(files, capsys):
    """The data-lost case: eval --model RUN --output-dir RUN overwrote the run's samples.jsonl."""
    run = files["run"]
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    said = expect_cli("CLEAR", [*argv(files)[:-2], "--output-dir", str(run)], capsys, "holds a training run")
    assert "--overwrite" in said
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


@pytest.mark.parametrize(("cls",), [case(AREA, "--output-dir = the run dir", "CLEAR")])
def test_output_folders_of_other_commands(files, tmp_path, capsys, cls):
    compare = tmp_path / "compare"
    compare.mkdir()
    (compare / "report.json").write_text("{}")
    expect_cli(
        cls, [*argv(files)[:-2], "--output-dir", str(compare)], capsys, "outputs that eval did not write"
    )
    samples_only = tmp_path / "samples_only"
    samples_only.mkdir()
    (samples_only / "samples.jsonl").write_text("{}\n")  # not eval's (no eval.json next to it)
    expect_cli(cls, [*argv(files)[:-2], "--output-dir", str(samples_only)], capsys, "(samples.jsonl)")
    file_out = tmp_path / "file_out"
    file_out.write_text("x")
    expect_cli(cls, [*argv(files)[:-2], "--output-dir", str(file_out)], capsys, "is a file")


def test_eval_replaces_its_own_outputs_and_overwrite_is_explicit(files, tmp_path, capsys):
    out = tmp_path / "again"
    for _ in range(2):  # the same command twice: its own outputs are replaced
        expect_cli("OK", [*argv(files)[:-2], "--output-dir", str(out)], capsys, "wrote")
    assert json.loads((out / "eval.json").read_text())["datasets"]["sums"]["num_prompts"] == 2
    run = tmp_path / "run_copy"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"phase": "rl", "step": 1}) + "\n")
    expect_cli("OK", [*argv(files)[:-2], "--output-dir", str(run), "--overwrite"], capsys, "wrote")
    assert (run / "metrics.jsonl").exists() and (run / "eval.json").exists()


class NotSGLang(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    ("cls", "kind", "words"),
    [
        case(AREA, "--urls to a non-SGLang server", "CLEAR", "404", "answers 404 to GET /health"),
        case(AREA, "--urls keyed server without key", "CLEAR", "keyed", "401"),
    ],
)
def test_eval_against_servers_that_do_not_fit(files, capsys, cls, kind, words):
    if kind == "404":
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotSGLang)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url, stop = f"http://127.0.0.1:{httpd.server_address[1]}", httpd.shutdown
    else:
        server = CPUServer(engine_from(files["moe"], seed=0), api_key="k3y").start()
        url, stop = server.url, server.stop
    try:
        args = ["eval", str(files["config"]), "--urls", url, "--data", f"sums={files['data']}"]
        expect_cli(cls, [*args, "--output-dir", str(files["root"] / "out_urls")], capsys, words)
    finally:
        stop()


@pytest.mark.parametrize(
    ("cls", "target", "words"),
    [
        case(AREA, "report: missing dir", "CLEAR", "ROOT/nowhere", "no metrics.jsonl"),
        case(AREA, "report: dir without metrics", "CLEAR", "ROOT/empty_dir", "no metrics.jsonl"),
        case(AREA, "report: torn metrics line", "OK", "TORN", "wrote"),
    ],
)
def test_hostile_report_folders(files, tmp_path, capsys, cls, target, words):
    pytest.importorskip("matplotlib")
    if target == "TORN":
        torn = tmp_path / "torn"
        torn.mkdir()
        rows = [{"phase": "rl", "step": s, "reward/mean": 0.1 * s} for s in (1, 2)]
        (torn / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows) + '{"phase": "rl", "st'
        )
        target = str(torn)
    expect_cli(cls, ["report", target.replace("ROOT", str(files["root"]))], capsys, words)
