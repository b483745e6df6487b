"""Commands that must not write into runs they don't own, tell runs apart, read a consistent checkpoint, and
check W&B at start-up (issue 39, area "commands"). On 3855bb6: ``compare --runs RUN --output-dir RUN/report``
overwrote the run's report (DATA-LOST), three runs whose paths end alike became two arms and a run plus a link to
it two configurations (SILENT), ``eval`` of a run whose checkpoint was pruned mid-read raised
``FileNotFoundError``, and W&B online without a key failed with wandb's traceback after the model loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sapo_megatron.checkpoint import atomic
from sapo_megatron.compare.finished import run_arms
from sapo_megatron.eval import cli as eval_cli
from sapo_megatron.runtime.wandb_tracking import check_wandb_key
from tests.security.hostile import case, expect, expect_cli

AREA = "commands"


def fake_run(path: Path) -> Path:
    (path / "report").mkdir(parents=True)
    (path / "metrics.jsonl").write_text(json.dumps({"phase": "rl", "step": 1, "reward/mean": 0.5}) + "\n")
    (path / "config.yaml").write_text("algorithm: {loss: {name: sapo}}\n")
    (path / "report" / "report.md").write_text("THE RUN'S OWN REPORT\n")
    return path


@pytest.mark.parametrize("cls", [case(AREA, "compare --output-dir inside a run", "CLEAR")])
@pytest.mark.parametrize("inside", ["report", "report/deeper", "link"])
def test_compare_never_writes_into_a_run(tmp_path, capsys, cls, inside):
    run = fake_run(tmp_path / "run")
    out = run / inside
    if inside == "link":  # a link outside the run that points into it
        out = tmp_path / "elsewhere"
        out.symlink_to(run / "report")
    expect_cli(
        cls, ["compare", "--runs", str(run), "--output-dir", str(out)], capsys, "inside the training run"
    )
    assert (run / "report" / "report.md").read_text() == "THE RUN'S OWN REPORT\n"
    expect_cli(
        cls, ["compare", "--runs", str(run), "--output-dir", str(out), "--overwrite"], capsys, "inside"
    )


@pytest.mark.parametrize("cls", [case(AREA, "three runs whose paths end alike", "OK")])
def test_runs_whose_paths_end_alike_are_distinct_arms(tmp_path, cls):
    runs = [fake_run(tmp_path / top / "x" / "run") for top in ("a", "b", "c")]
    arms = expect(cls, lambda: run_arms([str(r) for r in runs]))
    assert len(arms) == 3
    assert sorted(arm.label for arm, _ in arms.values()) == ["a-x-run", "b-x-run", "c-x-run"]
    two = run_arms([str(fake_run(tmp_path / "p" / "one")), str(fake_run(tmp_path / "q" / "two"))])
    assert sorted(arm.label for arm, _ in two.values()) == ["one", "two"]  # short labels where they suffice


@pytest.mark.parametrize("cls", [case(AREA, "a run and a symlink to it", "WARN")])
def test_a_run_and_a_link_to_it_are_one_arm(tmp_path, capsys, cls):
    run = fake_run(tmp_path / "run")
    link = tmp_path / "alias"
    link.symlink_to(run)
    arms = run_arms([str(run), str(link), str(tmp_path / "." / "run")])
    assert len(arms) == 1
    said = capsys.readouterr().err
    assert cls == "WARN" and f"{link} is the run {run} again" in said and "reported once" in said


def fake_checkpoint_run(root: Path, step: int) -> Path:
    run = root / "run"
    (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (run / "checkpoints" / f"step_{step}" / atomic.MARKER).write_text("{}")
    (run / "checkpoints" / atomic.LATEST).write_text(f"step_{step}\n")
    (run / "config.yaml").write_text("model: {}\n")
    return run


@pytest.mark.parametrize("cls", [case(AREA, "eval --model on a run that is training", "OK")])
def test_eval_of_a_run_that_prunes_mid_read_takes_its_newest_checkpoint(tmp_path, monkeypatch, cls):
    run = fake_checkpoint_run(tmp_path, 2)
    used = []

    def convert(checkpoint, out, run_config):
        used.append(checkpoint.name)
        if checkpoint.name == "step_2":  # the run saves step 4 and prunes step 2 while it is read
            (run / "checkpoints" / "step_4").mkdir()
            (run / "checkpoints" / "step_4" / atomic.MARKER).write_text("{}")
            (run / "checkpoints" / atomic.LATEST).write_text("step_4\n")
            (run / "checkpoints" / "step_2" / atomic.MARKER).unlink()
            (run / "checkpoints" / "step_2").rmdir()
            raise FileNotFoundError(checkpoint / "common.pt")
        return out

    monkeypatch.setattr(eval_cli, "_convert", convert)
    hf, config = expect(cls, lambda: eval_cli.resolve_model(str(run), tmp_path / "out"))
    assert used == ["step_2", "step_4"] and hf == tmp_path / "out" / "hf_model"
    assert config == run / "config.yaml"


def test_eval_of_a_run_that_keeps_pruning_is_refused_in_one_line(tmp_path, monkeypatch):
    run = fake_checkpoint_run(tmp_path, 2)

    def convert(checkpoint, out, run_config):
        (run / "checkpoints" / atomic.MARKER).unlink(missing_ok=True)
        for child in (run / "checkpoints").iterdir():
            if child.is_dir():
                (child / atomic.MARKER).unlink()
                child.rmdir()
        raise FileNotFoundError(checkpoint)

    monkeypatch.setattr(eval_cli, "_convert", convert)
    expect(
        "CLEAR", lambda: eval_cli.resolve_model(str(run), tmp_path / "out"), "was removed while it was read"
    )


@pytest.mark.parametrize("cls", [case(AREA, "wandb online without an API key", "CLEAR")])
def test_wandb_online_without_a_key_is_one_line_before_training(tmp_path, cls):
    none = tmp_path / "netrc-none"
    expect(cls, lambda: check_wandb_key("online", {}, none), "no W&B API key", "tracking.wandb.mode: offline")
    check_wandb_key("online", {"WANDB_API_KEY": "x" * 40}, none)
    check_wandb_key("offline", {}, none)
    check_wandb_key("online", {"WANDB_MODE": "offline"}, none)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    check_wandb_key("online", {}, netrc)
