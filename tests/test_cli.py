"""The command line: --version, --launch-info, help with defaults, resume modes, one-line errors with train.log
keeping the traceback, Ctrl-C, and real runs of the tiny demo into used, empty and failing directories."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sapo_megatron import __version__, cli
from sapo_megatron.cli import build_parser, main, resume_command, run_mode
from sapo_megatron.errors import RunInterrupted, UserError
from sapo_megatron.runtime import logs
from sapo_megatron.runtime.run_dir import prepare_run_dir
from tests.test_run_dir import snapshot

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "--set", "sft.steps=2", "--set", "sft.global_batch=4", "--set", "trainer.steps=2",
    "--set", "trainer.prompts_per_step=2", "--set", "rollout.n_samples=2", "--set", "eval.every=0",
    "--set", "trainer.save_every=1", "--set", "data.train_size=8", "--set", "eval.datasets.0.size=4",
]  # fmt: skip


def sapo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sapo_megatron.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )


def subparser(name: str):
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    return commands.choices[name]


# --------------------------------------------------------------------------------------------------------
# Small options
# --------------------------------------------------------------------------------------------------------


def test_version():
    proc = sapo("--version")
    assert proc.returncode == 0 and proc.stdout == f"sapo-megatron {__version__}\n"


def test_launch_info_prints_one_line_of_the_resolved_config(capsys):
    config = str(REPO / "configs/qwen3_30b_a3b_sapo_h100.yaml")
    assert main(["train", config, "--launch-info"]) == 0
    assert capsys.readouterr().out == "nodes=4 procs_per_node=8 world_size=32\n"
    assert main(["train", "--set", "launch.procs_per_node=2", "--launch-info"]) == 0
    assert capsys.readouterr().out == "nodes=1 procs_per_node=2 world_size=2\n"


def option_blocks(help_text: str) -> dict[str, str]:
    """``--option`` -> its help text, from an argparse help screen."""
    blocks: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        match = re.match(r"^  (-\w, )?(--[\w-]+)", line)
        if match:
            current = match.group(2)
            blocks[current] = line[match.end() :]
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return {name: " ".join(text.split()) for name, text in blocks.items()}


def test_every_train_option_has_help_with_its_default():
    train = subparser("train")
    blocks = option_blocks(train.format_help())
    options = [a for a in train._actions if a.option_strings and a.dest != "help"]
    assert {a.option_strings[-1] for a in options} <= set(blocks)
    for action in options:
        text = blocks[action.option_strings[-1]]
        assert action.help, action.option_strings
        if action.nargs != 0:  # flags are off unless given
            assert "default" in text, (action.option_strings, text)
    assert "(default: start a new run)" in blocks["--resume"]


def test_options_of_every_command_show_their_default():
    def parsers(parser):
        yield parser
        for action in parser._actions:
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                for sub in action.choices.values():
                    yield from parsers(sub)

    checked = set()
    for parser in parsers(build_parser()):
        blocks = option_blocks(parser.format_help())
        for action in parser._actions:
            if (
                action.option_strings
                and cli._shows_default(action)
                and action.dest not in ("help", "version")
            ):
                # the help lists the first long option
                shown = next(o for o in action.option_strings if o.startswith("--"))
                assert "default" in blocks[shown], (parser.prog, action.option_strings)
                checked.add(f"{parser.prog} {shown}")
    assert {"sapo-megatron serve --port", "sapo-megatron convert verify --batch"} <= checked, checked


@pytest.mark.parametrize(
    ("argv", "config", "mode"),
    [
        ([], None, "new"),
        (["--resume"], None, "resume"),
        (["--resume", "auto"], None, "auto"),
        (["--resume=auto"], None, "auto"),
        (["--overwrite"], None, "overwrite"),
        (["--resume", "run.yaml"], "run.yaml", "resume"),
        (["run.yaml", "--resume", "--debug"], "run.yaml", "resume"),
        (["run.yaml", "--resume", "auto"], "run.yaml", "auto"),
    ],
)
def test_resume_modes(argv, config, mode):
    args = build_parser().parse_args(cli._normalise_resume(["train", *argv]))
    assert args.config == config and run_mode(args) == mode


def test_resume_and_overwrite_together_are_refused(capsys):
    assert main(["train", "--resume", "--overwrite"]) == 1
    assert capsys.readouterr().err == (
        "sapo-megatron: --resume and --overwrite contradict each other\n"
        "hint: --resume continues the run in the output directory, --overwrite deletes it\n"
    )


def test_resume_command():
    assert resume_command(["train", "c.yaml", "--overwrite", "--set", "a=1"]) == (
        "sapo-megatron train c.yaml --set a=1 --resume"
    )
    assert resume_command(["train", "--resume", "auto", "--output-dir", "my runs/x"]) == (
        "sapo-megatron train --output-dir 'my runs/x' --resume"
    )
    assert resume_command(["train", "--resume", "c.yaml"]) == "sapo-megatron train c.yaml --resume"


# --------------------------------------------------------------------------------------------------------
# How errors are reported
# --------------------------------------------------------------------------------------------------------


class DataProblem(UserError):
    exit_code = 3


@pytest.fixture
def failing_train(monkeypatch, tmp_path):
    """Make ``train`` attach a run log in ``tmp_path`` and raise the exception given."""

    def use(exc: BaseException) -> Path:
        def handler(args):
            logs.attach_run_log(tmp_path / "train.log", header="test")
            print("starting")
            raise exc

        monkeypatch.setattr(cli, "_train", handler)
        return tmp_path / "train.log"

    return use


def test_a_user_error_is_one_line_and_a_hint_with_the_traceback_in_train_log(failing_train, capsys):
    log = failing_train(DataProblem("data.train: /x.jsonl does not exist", hint="check the path"))
    assert main(["train"]) == 3
    captured = capsys.readouterr()
    assert captured.err == "sapo-megatron: data.train: /x.jsonl does not exist\nhint: check the path\n"
    text = log.read_text()
    assert "starting\n" in text and "Traceback (most recent call last)" in text
    assert "DataProblem: data.train: /x.jsonl does not exist" in text
    assert text.rstrip().endswith("hint: check the path")


def test_debug_shows_the_traceback(failing_train, capsys):
    failing_train(DataProblem("broken", hint="fix it"))
    assert main(["train", "--debug"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and err.endswith(
        "sapo-megatron: broken\nhint: fix it\n"
    )


def test_an_interrupted_run_says_how_to_resume(failing_train, capsys):
    failing_train(RunInterrupted("interrupted at RL step 48 (SIGINT); checkpoint step_000048 written"))
    assert main(["train", "c.yaml", "--set", "x=1"]) == 130
    assert capsys.readouterr().err == (
        "sapo-megatron: interrupted at RL step 48 (SIGINT); checkpoint step_000048 written; "
        "resume with: sapo-megatron train c.yaml --set x=1 --resume\n"
    )


def test_keyboard_interrupt_is_one_line(failing_train, capsys):
    log = failing_train(KeyboardInterrupt())
    assert main(["train"]) == 130
    assert capsys.readouterr().err == "sapo-megatron: interrupted\n"
    assert "KeyboardInterrupt" in log.read_text()


def test_a_bug_keeps_its_traceback(failing_train, capsys):
    log = failing_train(ZeroDivisionError("division by zero"))
    assert main(["train"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and "ZeroDivisionError" in err
    assert "ZeroDivisionError: division by zero" in log.read_text()


def test_other_ranks_exit_quietly_with_the_same_code(failing_train, capsys, monkeypatch):
    log = failing_train(DataProblem("broken"))
    monkeypatch.setenv("RANK", "1")
    assert main(["train"]) == 3
    assert capsys.readouterr() == ("starting\n", "")
    assert not log.exists()  # only the main rank writes train.log


def test_cpu_fallback_warnings_are_filtered_without_cuda(recwarn):
    import warnings

    import torch

    with warnings.catch_warnings():
        assert logs.filter_cpu_fallback_warnings() == (not torch.cuda.is_available())
        warnings.warn(
            "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", stacklevel=1
        )
        warnings.warn("Apex is not installed. Falling back to Torch Norm", stacklevel=1)
        warnings.warn("something else", stacklevel=1)
    assert [str(w.message) for w in recwarn] == ["something else"]


# --------------------------------------------------------------------------------------------------------
# Real runs of the tiny demo
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    return run_dir, sapo("train", "--output-dir", str(run_dir), *TINY)


@pytest.mark.slow
def test_a_run_writes_its_log_without_megatron_fallback_warnings(finished_run):
    run_dir, proc = finished_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not installed" not in proc.stderr
    # quiet: no warning line, no weight-loading bar; Megatron's INFO (DDP config, bucket lists) only with
    # --verbose
    assert not re.search(r"warn|deprecat|Loading weights", proc.stderr, flags=re.I), proc.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "Params for bucket" not in log and " INFO megatron" not in log and "Warning" not in log
    assert log.startswith("=====") and "mode new, fresh start" in log.splitlines()[0]
    assert re.search(r"^accuracy \d\.\d{3} -> \d\.\d{3} in 2 RL steps", log, flags=re.M)
    assert re.search(r"^rl: 100%.*2/2", log, flags=re.M)  # the bar's final state, once
    assert "\r" not in log


@pytest.mark.slow
def test_a_second_run_into_the_directory_is_refused_and_touches_nothing(finished_run):
    run_dir, _ = finished_run
    before = snapshot(run_dir)
    proc = sapo("train", "--output-dir", str(run_dir), *TINY)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-2].startswith(f"sapo-megatron: {run_dir} already holds a run")
    assert (
        lines[-1]
        == "hint: continue it with --resume, replace it with --overwrite, or choose another --output-dir"
    )
    assert "Traceback" not in proc.stderr
    assert snapshot(run_dir) == before  # train.log included


@pytest.mark.slow
def test_resume_auto_continues_a_run_with_a_checkpoint(finished_run):
    run_dir, _ = finished_run
    proc = sapo("train", "--output-dir", str(run_dir), *TINY, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from step_000002 (sft step 2, rl step 2)" in proc.stdout
    log = (run_dir / "train.log").read_text()
    assert log.count("=====") == 4 and "mode auto, resuming from step_000002" in log  # two header lines


@pytest.mark.slow
def test_resume_of_an_empty_directory_is_refused(tmp_path):
    proc = sapo("train", "--output-dir", str(tmp_path / "run"), *TINY, "--resume")
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-2:] == [
        f"sapo-megatron: nothing to resume: {tmp_path / 'run'} holds no run",
        "hint: start a new run without --resume (--resume auto does either)",
    ]
    assert not (tmp_path / "run" / "train.log").exists()


@pytest.mark.slow
def test_a_missing_input_is_refused_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    proc = sapo(
        "train", "--output-dir", str(run_dir), *TINY, "--set", f"data.train={tmp_path / 'missing.jsonl'}"
    )
    assert proc.returncode == 2 and "data.train" in proc.stderr and "missing.jsonl" in proc.stderr
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_failed_start_leaves_only_its_log(tmp_path):
    run_dir, bad = tmp_path / "run", tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "2+2=",\n')
    proc = sapo("train", "--output-dir", str(run_dir), *TINY, "--set", f"data.train={bad}")
    assert proc.returncode == 1 and "bad.jsonl:2" in proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["train.log"]
    assert "bad.jsonl:2" in (run_dir / "train.log").read_text()
    assert prepare_run_dir(run_dir, mode="new").note is None  # the next run starts, with nothing to clean


@pytest.mark.slow
@pytest.mark.parametrize("procs", [1, 2])
def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, procs):
    """SIGINT to the foreground process group, as a terminal sends it (with 2 ranks: to the launcher)."""
    command = [
        sys.executable,
        "-m",
        "sapo_megatron.cli",
        "train",
        "--output-dir",
        str(tmp_path / "run"),
        *TINY,
    ]
    command += ["--set", "sft.steps=100000", "--set", f"launch.procs_per_node={procs}"]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while (
            not list(tmp_path.glob("run/metrics.jsonl"))
            or not (tmp_path / "run/metrics.jsonl").stat().st_size
        ):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    interrupted = [line for line in err.splitlines() if line.startswith("sapo-megatron: interrupted")]
    assert len(interrupted) == 1, err[-3000:]
