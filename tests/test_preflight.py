"""One list of start-up checks (:data:`sapo_megatron.loop.preflight.STARTUP_CHECKS`): ``train``, ``train
--dry-run`` and the session each run it, so a bad config is refused by all three with the same line; and the
session is built in one place and frozen after."""

from __future__ import annotations

import dataclasses

import pytest

from sapo_megatron.cli import main
from sapo_megatron.config import ConfigError, load_config
from sapo_megatron.loop import preflight
from sapo_megatron.loop.session import Session, open_session


def refusals(tmp_path, capsys, *sets: str) -> dict[str, str]:
    """The error of ``train`` and of ``train --dry-run`` with ``--set sets`` (without the hint), and the session's."""
    overrides = [arg for key in sets for arg in ("--set", key)]
    lines = {}
    for name, extra in (("train", []), ("dry run", ["--dry-run"])):
        out = tmp_path / name.replace(" ", "_")
        assert main(["train", "--output-dir", str(out), *overrides, *extra]) == 2
        err = capsys.readouterr().err
        start = err.index("sapo-megatron: ")
        lines[name] = err[start:].split("\nhint: ")[0].strip()  # the message, without its hint
        assert not out.exists()  # refused before the run directory was made
    cfg = load_config(
        None, dict(key.split("=", 1) for key in sets) | {"output_dir": str(tmp_path / "session")}
    )
    with pytest.raises(ConfigError) as info, open_session(cfg, mode="new"):
        pass
    lines["session"] = f"sapo-megatron: configuration error: {info.value}"
    assert not (tmp_path / "session").exists()
    return lines


def test_the_dry_run_train_and_the_session_refuse_a_missing_input_with_the_same_line(tmp_path, capsys):
    lines = refusals(tmp_path, capsys, f"data.train={tmp_path / 'missing.jsonl'}")
    missing = f"  - data.train: {tmp_path / 'missing.jsonl'} does not exist"
    assert lines["train"] == lines["dry run"] == lines["session"]
    assert lines["train"] == f"sapo-megatron: configuration error: missing input files:\n{missing}"


def test_every_entry_runs_the_one_list(tmp_path, capsys, monkeypatch):
    """A check added to STARTUP_CHECKS is run by all three, before anything is written."""
    seen = []

    def refuse_odd_seeds(cfg) -> None:
        seen.append(cfg.seed)
        if cfg.seed % 2:
            raise ConfigError(f"seed={cfg.seed} is odd: use an even seed")

    monkeypatch.setattr(preflight, "STARTUP_CHECKS", (*preflight.STARTUP_CHECKS, refuse_odd_seeds))
    lines = refusals(tmp_path, capsys, "seed=7")
    assert set(lines.values()) == {"sapo-megatron: configuration error: seed=7 is odd: use an even seed"}
    assert seen == [7, 7, 7]


def test_the_session_is_frozen_and_gets_its_checkpointer_when_built():
    assert Session.__dataclass_params__.frozen
    fields = {field.name: field for field in dataclasses.fields(Session)}
    assert fields["checkpointer"].default is dataclasses.MISSING  # built with the session, not set later
    assert all(
        field.default is dataclasses.MISSING
        for name, field in fields.items()
        if name not in ("teachers", "_server")
    )
