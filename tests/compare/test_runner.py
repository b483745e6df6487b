"""The runner with a stand-in trainer (tests/compare/fake_train.py): the order of runs and the progress lines,
skipping finished runs, re-running unfinished ones, failures, --overwrite, signals, and an output directory
or request that is refused before anything runs."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from sapo_megatron.compare import (
    Arm,
    CompareError,
    CompareInterrupted,
    build_plan,
    grid_points,
    parse_grid,
    plan_arms,
    run_compare,
)
from sapo_megatron.compare.report import require_matplotlib
from sapo_megatron.compare.runner import WarmStartError, describe, error_line

FAKE = Path(__file__).with_name("fake_train.py")
SMALL = {"sft.steps": 20, "sft.global_batch": 16, "trainer.prompts_per_step": 4, "rollout.n_samples": 4}
ARMS = ["sapo-none-none-s0", "grpo-none-none-s0"]


def fake(config_path: Path) -> list[str]:
    return [sys.executable, str(FAKE), str(config_path)]


def make_plan(root: Path, steps: int = 3, losses=("sapo", "grpo"), grid=()):
    return build_plan(
        None,
        SMALL,
        losses=losses,
        replays=["none"],
        corrections=["none"],
        seeds=1,
        steps=steps,
        output_dir=root,
        grid=grid,
    )


def compare(root: Path, steps: int = 3, **kwargs):
    out = io.StringIO()
    outcome = run_compare(make_plan(root, steps), out=out, command=fake, **kwargs)
    return outcome, out.getvalue().splitlines()


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FAKE_TRAIN_LOG", str(tmp_path / "started.txt"))
    monkeypatch.delenv("FAKE_TRAIN", raising=False)
    return tmp_path / "cmp"


def started(root: Path) -> list[str]:
    log = root.parent / "started.txt"
    return log.read_text().split() if log.exists() else []


def test_runs_the_warm_start_then_each_arm_then_skips_them_all(root):
    outcome, lines = compare(root)
    assert outcome.ran == ["warm_start", *ARMS] and outcome.failures == {}
    assert (
        lines[0]
        == f"2 arms: losses sapo, grpo × replay none × corrections none × seeds 0, 3 RL steps each, into {root}."
    )
    assert re.fullmatch(
        r"warm start \(20 SFT steps\) \.\.\. done in \d+ s", lines[4]
    )  # seconds: machine load
    assert re.fullmatch(
        r"\[1/2\] sapo-none-none-s0 \.\.\. done in \d+ s: reward 0\.5, collapsed no", lines[5]
    )
    assert re.fullmatch(
        r"\[2/2\] grpo-none-none-s0 \.\.\. done in \d+ s: reward 0\.5, collapsed no", lines[6]
    )
    assert lines[7] == f"report: {root / 'report.md'} (data: report.json, plots: {root / 'plots'})"
    arm_config = (root / ARMS[0] / "compare.yaml").read_text()
    assert f"output_dir: {root / ARMS[0]}" in arm_config  # the command it ran is reproducible by hand
    report_before = (root / "report.json").stat().st_mtime_ns

    outcome, lines = compare(root)
    assert outcome.ran == [] and started(root) == ["warm_start", *ARMS]
    assert lines[4:7] == [
        "warm start (20 SFT steps) ... finished earlier",
        "[1/2] sapo-none-none-s0 ... finished earlier: reward 0.5, collapsed no",
        "[2/2] grpo-none-none-s0 ... finished earlier: reward 0.5, collapsed no",
    ]
    assert (root / "report.json").stat().st_mtime_ns > report_before  # the report is written again
    assert [arm["loss"] for arm in json.loads((root / "report.json").read_text())["arms"]] == ["sapo", "grpo"]


def test_only_unfinished_runs_run_again(root):
    compare(root)
    (root / ARMS[1] / "summary.json").unlink()  # as if the compare was killed during the second arm
    outcome, lines = compare(root)
    assert outcome.ran == [ARMS[1]]
    assert lines[5].endswith("finished earlier: reward 0.5, collapsed no")
    assert re.fullmatch(
        r"\[2/2\] grpo-none-none-s0 \.\.\. done in \d+ s: reward 0\.5, collapsed no", lines[6]
    )


def test_more_arms_later_run_only_the_new_ones(root):
    run_compare(make_plan(root, losses=("sapo",)), out=io.StringIO(), command=fake)
    outcome, _ = compare(root)
    assert outcome.ran == [ARMS[1]]


def test_a_failed_arm_is_reported_and_the_next_one_still_runs(root, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", json.dumps({ARMS[0]: "fail"}))
    outcome, lines = compare(root)
    message = "3 optimizer steps in a row had a non-finite loss or gradient norm (hint: lower optimizer.lr)"
    assert outcome.failures == {ARMS[0]: message}
    assert outcome.ran == ["warm_start", *ARMS]
    log = root / ARMS[0] / "train.log"
    assert re.fullmatch(
        re.escape("[1/2] sapo-none-none-s0 ... failed (exit 1) after ")
        + r"\d+"
        + re.escape(f" s: {message}; log: {log}"),
        lines[5],
    )
    assert lines[-1] == "1 of 2 arms failed: sapo-none-none-s0"
    report = json.loads((root / "report.json").read_text())
    assert report["arms"][0]["final"]["collapsed"] is True  # it stopped on non-finite updates
    assert "`sapo-none-none-s0` | failed |" in (root / "report.md").read_text()

    monkeypatch.setenv("FAKE_TRAIN", "{}")
    outcome, _ = compare(root)  # a failed arm is tried again
    assert outcome.ran == [ARMS[0]] and outcome.failures == {}


def test_an_arm_killed_without_a_word_is_a_failure_with_its_exit_status(root, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", json.dumps({ARMS[1]: "sigkill"}))
    outcome, lines = compare(root)
    assert outcome.failures == {ARMS[1]: "exit status -9"}
    assert re.match(
        r"\[2/2\] grpo-none-none-s0 \.\.\. failed \(exit -9\) after \d+ s: exit status -9; log: ", lines[6]
    )
    report = json.loads((root / "report.json").read_text())
    assert report["arms"][1]["final"]["collapsed"] is False  # a kill is no evidence of a collapse


def test_a_failed_warm_start_stops_the_compare(root, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", json.dumps({"warm_start": "fail"}))
    with pytest.raises(WarmStartError, match=r"^the warm start failed \(exit 1\): 3 optimizer steps") as err:
        compare(root)
    assert str(root / "warm_start" / "train.log") in err.value.hint
    assert started(root) == ["warm_start"]


def test_overwrite_starts_everything_over_even_with_another_config(root):
    compare(root)
    with pytest.raises(CompareError, match=r"holds a run of another configuration \(trainer.steps: 3 → 4\)"):
        compare(root, steps=4)
    outcome, lines = compare(root, steps=4, overwrite=True)
    assert outcome.ran == ["warm_start", *ARMS]
    assert lines[0].startswith(
        f"removed the previous comparison in {root} (grpo-none-none-s0, plots, report.json"
    )
    assert json.loads((root / "report.json").read_text())["arms"][0]["steps"] == 4


def test_a_run_written_before_a_config_field_existed_is_still_the_same_run(root):
    """An upgrade adds config fields: a run whose config.yaml lacks one (at its default) continues; a field that
    differs still refuses."""
    compare(root)
    written = root / ARMS[0] / "config.yaml"
    data = yaml.safe_load(written.read_text())
    del data["algorithm"]["opd_student_logp"], data["teachers"]  # fields added after such a run was written
    written.write_text(yaml.safe_dump(data))
    outcome, _ = compare(root)
    assert outcome.ran == []
    data["algorithm"]["opd_student_logp"] = "engine"
    written.write_text(yaml.safe_dump(data))
    with pytest.raises(CompareError, match=r"algorithm.opd_student_logp: 'engine' → 'trainer'"):
        compare(root)


def test_an_output_directory_with_other_things_is_refused_before_anything_runs(root):
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    (root / "config.yaml").write_text("a run of train")
    with pytest.raises(
        CompareError, match=r"holds config.yaml, notes.txt, which a compare does not write"
    ) as err:
        compare(root)
    assert "choose an empty or new --output-dir" in err.value.hint
    with pytest.raises(CompareError):
        compare(root, overwrite=True)  # --overwrite never deletes what a compare did not write
    assert started(root) == [] and (root / "notes.txt").read_text() == "mine"


def test_an_output_directory_that_is_a_file_is_refused(root):
    root.parent.mkdir(exist_ok=True)
    root.write_text("x")
    with pytest.raises(CompareError, match=r"is a file"):
        compare(root)


def test_missing_matplotlib_is_refused_before_anything_runs_with_the_install_command(root, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if it were not installed
    with pytest.raises(CompareError, match=r"matplotlib, which is not installed") as err:
        compare(root)
    assert err.value.hint == "pip install 'sapo-megatron[report]' (or: pip install 'matplotlib>=3.8')"
    assert started(root) == []
    monkeypatch.undo()
    require_matplotlib()


def test_a_signal_reaches_the_running_arm_and_stops_the_compare(root, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", json.dumps({ARMS[0]: "wait_for_signal"}))

    def interrupt_once_started() -> None:
        deadline = time.monotonic() + 30
        while not (root / ARMS[0] / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # to the compare only: it must pass it on

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    with pytest.raises(CompareInterrupted, match=r"interrupted at sapo-none-none-s0 \(SIGINT\)") as err:
        compare(root)
    assert err.value.exit_code == 130 and "run the same command again" in err.value.hint
    assert (root / ARMS[0] / "signals").read_text() == "1"
    assert started(root) == ["warm_start", ARMS[0]]  # the next arm did not start
    assert not (root / "report.json").exists()


@pytest.mark.parametrize(
    ("stderr", "line"),
    [
        ("warning\nsapo-megatron: bad thing\nhint: do this\n", "bad thing (hint: do this)"),
        ("sapo-megatron: first\nsapo-megatron: second\n", "second"),
        ("Traceback (most recent call last):\n  ...\nValueError: boom\n", "ValueError: boom"),
        ("", ""),
    ],
)
def test_the_error_line_of_a_failed_run(stderr, line):
    assert error_line(stderr) == line


def test_a_grid_compare_runs_one_arm_per_value_records_its_overrides_and_resumes(root):
    grid = parse_grid(["algorithm.loss.tau_pos=1,4,16"])
    plan = make_plan(root, steps=2, losses=("sapo",), grid=grid)
    names = ["sapo-none-none-tau_pos1-s0", "sapo-none-none-tau_pos4-s0", "sapo-none-none-tau_pos16-s0"]
    assert [run.name for run in plan.arms] == names
    assert [run.cfg.algorithm.loss.tau_pos for run in plan.arms] == [1.0, 4.0, 16.0]
    assert {run.cfg.algorithm.loss.tau_neg for run in plan.arms} == {1.05}  # the paper's, untouched
    out = io.StringIO()
    outcome = run_compare(plan, out=out, command=fake)
    assert outcome.ran == ["warm_start", *names]
    assert "× `algorithm.loss.tau_pos` 1, 4, 16 × seeds 0" in (root / "report.md").read_text()
    linked = parse_grid(["algorithm.loss.tau_pos+algorithm.loss.tau_neg=1:1.05,4:8"])
    linked_plan = make_plan(root, steps=2, losses=("sapo",), grid=linked)
    assert "× algorithm.loss.tau_pos+algorithm.loss.tau_neg 1:1.05, 4:8 × seeds 0" in describe(linked_plan)[0]
    arms = json.loads((root / "report.json").read_text())["arms"]
    assert [arm["overrides"] for arm in arms] == [{"algorithm.loss.tau_pos": v} for v in (1, 4, 16)]
    assert len({run.arm.colour_key for run in plan.arms}) == 3  # the plots tell the grid points apart
    again = run_compare(plan, out=io.StringIO(), command=fake)
    assert again.ran == [] and started(root) == ["warm_start", *names]


def test_grid_axes_cross_the_losses_and_bad_axes_are_refused():
    two = grid_points(parse_grid(["algorithm.loss.kl_coef=0,0.1", "trainer.mini_batches=1,2"]))
    assert two[1] == (("algorithm.loss.kl_coef", 0), ("trainer.mini_batches", 2)) and len(two) == 4
    arms = plan_arms(["sapo", "grpo"], ["none"], ["none"], 1, two)
    assert len(arms) == 8 and arms[7].name == "grpo-none-none-kl_coef0.1-mini_batches2-s0"
    assert (
        arms[7].overrides()["trainer.mini_batches"] == 2
        and arms[7].overrides()["algorithm.loss.kl_coef"] == 0.1
    )
    for option, message in (
        ("algorithm.loss.tau_pos", r"expected KEY=V1,V2"),
        ("seed=1,2", r"--grid seed: every arm gets its own"),
        ("algorithm.loss.name=sapo,grpo", r"--grid algorithm.loss.name: each arm's loss"),
        ("algorithm.routing_replay=r2,r3", r"use --replay"),
        ("trainer.steps=1,2", r"use --steps"),
        ("algorithm.loss.tau_pos=1,1", r"a value is listed twice"),
    ):
        with pytest.raises(CompareError, match=message):
            parse_grid([option])
    linked = grid_points(parse_grid(["algorithm.loss.tau_pos+algorithm.loss.tau_neg=1:1.05,4:8"]))
    assert linked == [
        (("algorithm.loss.tau_pos", 1), ("algorithm.loss.tau_neg", 1.05)),
        (("algorithm.loss.tau_pos", 4), ("algorithm.loss.tau_neg", 8)),
    ]
    assert Arm("sapo", "none", "none", 0, grid=linked[1]).name == "sapo-none-none-tau_pos4-tau_neg8-s0"
    with pytest.raises(CompareError, match=r"KEY1\+KEY2=A1:B1"):
        parse_grid(["algorithm.loss.tau_pos+algorithm.loss.tau_neg=1:1.05,4"])
    with pytest.raises(CompareError, match=r"given twice"):
        parse_grid(["algorithm.loss.tau_pos=1,2", "algorithm.loss.tau_pos=4"])
