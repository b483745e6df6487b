"""The command line answers before the heavy imports: --help / --version without torch, refusals (output
directory, bad --set, bad arguments) before Megatron and transformers, every error one line and a hint, help in
plain words, and the log and warning filters that keep a run's console quiet (bench/bench_cli_startup.py
measures the times)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from sapo_megatron import cli
from sapo_megatron.cli import build_parser, main
from sapo_megatron.runtime import logs
from sapo_megatron.runtime.run_dir import RunDirError, check_run_dir
from tests.test_run_dir import snapshot, started_run, write_rows

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "pydantic", "megatron", "transformers", "numpy")

PROBE = """
import json, sys
from sapo_megatron import cli
codes = []
for argv in json.loads(sys.argv[1]):
    try:
        codes.append(cli.main(argv))
    except SystemExit as exit:
        codes.append(exit.code)
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[2])))
print(json.dumps({"codes": codes, "heavy": heavy}), file=sys.__stderr__)
"""


def probe(*argvs: list[str]) -> tuple[list[int], list[str], str]:
    """Run ``cli.main`` on each argv in one fresh interpreter: (exit codes, heavy packages imported, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(argvs)), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=False,
    )
    *lines, last = proc.stderr.strip().splitlines()
    result = json.loads(last)
    return result["codes"], result["heavy"], "\n".join(lines)


def command_paths(parser, prefix=()):
    """Every (sub)command of the parser, as argv prefixes: ("train",), ("convert", "verify"), ..."""
    for action in parser._actions:
        if isinstance(getattr(action, "choices", None), dict):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from command_paths(sub, (*prefix, name))


def test_help_and_version_of_every_command_import_nothing_heavy():
    commands = list(command_paths(build_parser()))
    assert {("train",), ("plan",), ("serve",), ("convert", "verify")} <= set(commands)
    helps = [["--help"], ["--version"]] + [[*command, "--help"] for command in commands]
    codes, heavy, _ = probe(*helps)
    assert codes == [0] * len(helps)
    assert heavy == []


def test_plan_needs_neither_megatron_nor_transformers():
    codes, heavy, _ = probe(["plan"], ["train", "--dry-run"])
    assert codes == [0, 0]
    assert "megatron" not in heavy and "transformers" not in heavy


def test_a_refused_rerun_answers_before_megatron_and_transformers(tmp_path):
    run_dir = tmp_path / "run"
    started_run(run_dir)
    write_rows(run_dir, [("rl", 1)])
    before = snapshot(run_dir)
    codes, heavy, err = probe(["train", "--output-dir", str(run_dir)])
    assert codes == [1]
    assert err.splitlines() == [
        f"sapo-megatron: {run_dir} already holds a run (config.yaml, metrics.jsonl (rl up to step 1), "
        "tensorboard/, rollout_weights/; no checkpoint)",
        "hint: it has no checkpoint for --resume to continue from: replace it with --overwrite, "
        "or choose another --output-dir",
    ]
    assert "megatron" not in heavy and "transformers" not in heavy
    assert snapshot(run_dir) == before


def test_check_run_dir_refuses_as_prepare_run_dir_does_and_writes_nothing(tmp_path):
    leftovers = tmp_path / "leftovers"
    started_run(leftovers)
    before = snapshot(leftovers)
    assert check_run_dir(leftovers, mode="new").entries  # a failed start: allowed, and not yet cleaned
    assert snapshot(leftovers) == before
    with pytest.raises(RunDirError, match="nothing to resume"):
        check_run_dir(tmp_path / "absent", mode="resume")
    assert not (tmp_path / "absent").exists()


def test_a_bad_set_value_is_one_line_and_a_hint(capsys):
    assert main(["train", "--set", "trainer.steps=[1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "sapo-megatron: configuration error: --set 'trainer.steps=[1': the value is not valid YAML "
        "(expected ',' or ']', but got '<stream end>' at character 3)",
        "hint: values are YAML: 2, 1e-5, true, [1, 2], {a: 1}; quote a string that looks like YAML, "
        "e.g. --set \"trainer.steps='[1'\"",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--bogus"], "sapo-megatron: error: unrecognized arguments: --bogus"),
        (
            ["plan", "--world-size", "two"],
            "sapo-megatron plan: error: argument --world-size: invalid int value: 'two'",
        ),
        (["nonsense"], "sapo-megatron: error: argument COMMAND: invalid choice: 'nonsense'"),
    ],
)
def test_a_usage_error_is_one_line_and_a_hint(capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    first, hint = capsys.readouterr().err.splitlines()
    assert first.startswith(message), first
    assert re.fullmatch(r"hint: sapo-megatron( \w+)? --help lists the options", hint), hint


def test_help_is_plain_words():
    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(getattr(action, "choices", None), dict):
                for sub in action.choices.values():
                    yield from parsers(sub)

    texts = [parser.format_help() for parser in parsers(build_parser())]
    assert len(texts) >= 9  # the top level, 5 commands, convert's 3
    for text in texts:
        assert not re.search(r"``|:(class|func|mod|data|meth):|`[^`]+`", text), text
    assert "train (the RL loop" in texts[0]


def test_light_copies_match_their_sources():
    from sapo_megatron.compare import CORRECTIONS
    from sapo_megatron.rollout.cpu.flags import DIST_TIMEOUT_S
    from sapo_megatron.rollout.weight_group import DEFAULT_TIMEOUT_S

    assert tuple(CORRECTIONS) == cli.CORRECTION_NAMES
    assert DIST_TIMEOUT_S == DEFAULT_TIMEOUT_S


# --------------------------------------------------------------------------------------------------------
# Quiet output
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("verbose", [False, True])
def test_train_log_keeps_megatron_info_only_when_verbose(tmp_path, capsys, verbose):
    with logs.console(verbose=verbose):
        logs.attach_run_log(tmp_path / "train.log")
        logging.getLogger("megatron.core.distributed").info("Params for bucket 1")
        logging.getLogger("megatron.core.optimizer").warning("a real megatron warning")
        logging.getLogger("sapo_megatron.loop.session").info("our own info")
    log = (tmp_path / "train.log").read_text()
    assert "a real megatron warning" in log and "our own info" in log
    assert ("Params for bucket 1" in log) == verbose
    err = capsys.readouterr().err
    assert "a real megatron warning" in err
    assert ("Params for bucket 1" in err) == verbose


def test_known_harmless_warnings_are_filtered_by_module(recwarn):
    with warnings.catch_warnings():
        logs.filter_known_warnings()
        text = "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer."
        warnings.warn_explicit(text, UserWarning, "transformer_config.py", 1705, module="megatron.core.x")
        warnings.warn_explicit(text, UserWarning, "mine.py", 1, module="my_module")  # not Megatron's: shown
    assert [w.filename for w in recwarn] == ["mine.py"]
