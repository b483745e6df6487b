"""Running a comparison: the shared warm start, then every arm in turn, then the report.

Each run is a separate ``sapo-megatron train <run_dir>/compare.yaml --resume auto`` process: the same code path
as a user's own run (multi-rank launch, input checks, ``train.log``), and a fresh interpreter per arm, because
Megatron-Core keeps global parallel state. ``compare.yaml`` is the arm's resolved config, so that command
reproduces the arm by hand.

Resuming: an arm whose run directory has ``summary.json`` is finished and skipped; any other continues from its
newest checkpoint or starts over (``--resume auto``). A run directory holding a run of *another* config
(different ``--steps``, ``--set``, ...) is refused before anything starts, as is an output directory holding
anything a compare does not write. ``overwrite`` deletes what earlier compares wrote there first.

Signals: SIGINT / SIGTERM / SIGUSR1 are passed on to the running arm, which stops after its current step and
writes a checkpoint; the compare then stops (exit 130) and the same command continues it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from sapo_megatron.compare.arms import (
    ARM_CONFIG_FILE,
    ARM_NAME,
    CONFIG_ARM_NAME,
    TEACHERS_DIR,
    WARM_START_DIR,
    Arm,
    CompareError,
    ComparePlan,
    PlannedRun,
)
from sapo_megatron.compare.report import ReportFiles, load_arm_result, require_matplotlib, write_report
from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.errors import UserError
from sapo_megatron.runtime.interrupts import EXIT_NOW_CODE, InterruptGuard
from sapo_megatron.runtime.run_dir import TRASH_PREFIX

REPORT_ENTRIES = ("report.md", "report.json", "plots")
POLL_S = 0.1
"""How often the running arm is checked; well inside the trainer's 1 s window that merges a forwarded signal
with the same one from the terminal."""
STDERR_TAIL = 20_000

TrainCommand = Callable[[Path], list[str]]
"""Run config path → the command that runs it (tests substitute a stand-in for the trainer)."""


class WarmStartError(UserError):
    """The shared warm start failed: no arm can start."""


class CompareInterrupted(UserError):
    """A signal stopped the compare; the arm that was running wrote a checkpoint."""

    exit_code = EXIT_NOW_CODE


@dataclass
class CompareOutcome:
    report: ReportFiles
    failures: dict[str, str] = field(default_factory=dict)
    """Arm name → error line of the arms whose run failed."""
    ran: list[str] = field(default_factory=list)
    """Names of the runs started by this call (the others were finished already)."""


def train_command(config_path: Path, *, debug: bool = False) -> list[str]:
    """``sapo-megatron train CONFIG --resume auto`` in this interpreter."""
    command = [sys.executable, "-m", "sapo_megatron.cli", "train", str(config_path), "--resume", "auto"]
    return [*command, "--debug"] if debug else command


def preflight(plan: ComparePlan, *, overwrite: bool) -> None:
    """Every check that can fail before the first run starts (raises :class:`CompareError` / ``ConfigError``)."""
    from sapo_megatron.loop.inputs import check_input_files
    from sapo_megatron.rewards.runner import check_reward_available

    require_matplotlib()
    check_output_dir(plan, overwrite=overwrite)
    # The first run's inputs: later runs read the exports of the teachers and the warm start, made later.
    first = plan.teachers[0] if plan.teachers else plan.warm_start or plan.arms[0]
    check_input_files(first.cfg)
    check_reward_available(plan.base.algorithm.reward, kwargs=plan.base.algorithm.reward_kwargs)


def run_compare(
    plan: ComparePlan,
    *,
    overwrite: bool = False,
    debug: bool = False,
    out: TextIO | None = None,
    command: TrainCommand | None = None,
) -> CompareOutcome:
    """Run what is not finished yet, one run at a time, and write the report; see the module docstring.

    Prints one progress line per run to ``out`` (default stdout). Raises :class:`CompareError` (or
    ``ConfigError``) when the input is bad, :class:`WarmStartError` when the warm start fails and
    :class:`CompareInterrupted` on a signal; an arm that fails is recorded in
    the outcome (and the report) and the next arm runs."""
    out = out or sys.stdout
    command = command or (lambda path: train_command(path, debug=debug))
    prepare(plan, overwrite=overwrite, out=out)
    outcome_failures: dict[str, str] = {}
    ran: list[str] = []
    with InterruptGuard(announce=None) as guard:
        for teacher in plan.teachers:
            _warm_start(teacher, guard, command, out, ran, what=f"teacher {teacher.cfg.name}")
        if plan.warm_start is not None:
            _warm_start(plan.warm_start, guard, command, out, ran)
        for index, run in enumerate(plan.arms, start=1):
            _stop_if_asked(guard, run.name)
            failure = _arm(run, f"[{index}/{len(plan.arms)}]", guard, command, out, ran)
            if failure:
                outcome_failures[run.name] = failure
    return finish(plan, outcome_failures, ran, out)


def prepare(plan: ComparePlan, *, overwrite: bool, out: TextIO) -> None:
    """The checks, ``overwrite``'s clearing and the plan's description: what every way of running does first."""
    preflight(plan, overwrite=overwrite)
    if overwrite:
        removed = clear_output_dir(plan.output_dir)
        if removed:
            _say(out, f"removed the previous comparison in {plan.output_dir} ({', '.join(removed)})")
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    _remove_trash(plan.output_dir)
    for line in describe(plan):
        _say(out, line)


def finish(plan: ComparePlan, failures: dict[str, str], ran: list[str], out: TextIO) -> CompareOutcome:
    """Write the report of the plan's arms (``failures``: arm name → error line) and say where it is."""
    report = write_report(
        plan.output_dir,
        [run.arm for run in plan.arms if run.arm is not None],
        failures=failures,
        header=describe(plan, markdown=True),
    )
    _say(
        out,
        f"report: {report.markdown} (data: {report.json.name}, plots: {report.markdown.parent / 'plots'})",
    )
    if failures:
        _say(out, f"{len(failures)} of {len(plan.arms)} arms failed: {', '.join(failures)}")
    return CompareOutcome(report, failures, ran)


# --------------------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------------------


def is_finished(run: PlannedRun) -> bool:
    """A run is finished once it wrote ``summary.json`` (the warm start also needs its HF export)."""
    done = (run.run_dir / "summary.json").is_file()
    return done and (run.arm is not None or (run.run_dir / "hf" / "config.json").is_file())


def _warm_start(
    run: PlannedRun,
    guard: InterruptGuard,
    command: TrainCommand,
    out: TextIO,
    ran: list[str],
    what: str = "warm start",
) -> None:
    """Run a run every arm needs (the warm start, a teacher) unless finished; raise :class:`WarmStartError` if
    it fails."""
    rl = f", {run.cfg.trainer.steps} RL steps" if run.cfg.trainer.steps else ""
    prefix = f"{what} ({run.cfg.sft.steps} SFT steps{rl}) ..."
    if is_finished(run):
        _say(out, f"{prefix} finished earlier")
        return
    _say(out, prefix, end=" ")
    started = time.monotonic()
    rc, error = _execute(run, guard, command)
    ran.append(run.name)
    _stop_if_asked(guard, run.name, rc)
    if rc != 0:
        _say(out, "failed")
        raise WarmStartError(
            f"the {what} failed (exit {rc}): {error}",
            hint=f"see {run.run_dir / 'train.log'}; run the same command again once fixed",
        )
    _say(out, f"done in {time.monotonic() - started:.0f} s")


def _arm(
    run: PlannedRun, label: str, guard: InterruptGuard, command: TrainCommand, out: TextIO, ran: list[str]
) -> str | None:
    """Run one arm unless finished; print its line; return its failure (``None`` if it finished)."""
    assert run.arm is not None
    prefix = f"{label} {run.name} ..."
    if is_finished(run):
        _say(out, f"{prefix} finished earlier: {_verdict(run.arm, run.run_dir)}")
        return None
    _say(out, prefix, end=" ")
    started = time.monotonic()
    rc, error = _execute(run, guard, command)
    ran.append(run.name)
    _stop_if_asked(guard, run.name, rc)
    seconds = time.monotonic() - started
    if rc != 0:
        error = error or f"exit status {rc}"
        _say(out, f"failed (exit {rc}) after {seconds:.0f} s: {error}; log: {run.run_dir / 'train.log'}")
        return error
    _say(out, f"done in {seconds:.0f} s: {_verdict(run.arm, run.run_dir)}")
    return None


def _verdict(arm: Arm, run_dir: Path) -> str:
    result = load_arm_result(arm, run_dir)
    reward = result.final["reward"]
    reward_text = "n/a" if reward is None else f"{reward:.3g}"
    collapsed = f"yes ({'; '.join(result.reasons)})" if result.reasons else "no"
    return f"reward {reward_text}, collapsed {collapsed}"


def _execute(run: PlannedRun, guard: InterruptGuard, command: TrainCommand) -> tuple[int, str]:
    """Start the run's process and wait for it, passing a signal the compare receives on to it; returns the
    exit status and the error line it printed (empty when none)."""
    run.run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run.cfg.save_resolved(run.run_dir / ARM_CONFIG_FILE)
    with tempfile.TemporaryFile("w+") as stderr:
        # stdout (progress bars) is dropped: train.log in the run directory keeps the run's log.
        proc = subprocess.Popen(command(config_path), stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            rc = _wait(proc, guard)
        finally:
            if proc.poll() is None:  # only when the compare itself fails: leave no arm running on its own
                proc.kill()
                proc.wait()
        return rc, error_line(_tail(stderr))


def _wait(proc: subprocess.Popen, guard: InterruptGuard) -> int:
    """Wait for ``proc``, passing the first signal the compare receives on to it (once)."""
    forwarded = False
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if guard.requested and not forwarded and guard.signal_name:
            proc.send_signal(signal.Signals[guard.signal_name])
            forwarded = True


def error_line(stderr: str) -> str:
    """The message a failed ``sapo-megatron`` run printed: its ``sapo-megatron: ...`` line (with the ``hint:``
    after it), else the last line (a bug's exception)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].startswith("sapo-megatron:"):
            following = lines[index + 1] if index + 1 < len(lines) else ""
            hint = f" ({following})" if following.startswith("hint:") else ""
            return lines[index].removeprefix("sapo-megatron:").strip() + hint
    return lines[-1] if lines else ""


def _tail(handle) -> str:
    size = handle.seek(0, os.SEEK_END)
    handle.seek(max(0, size - STDERR_TAIL))
    return handle.read()


def _stop_if_asked(guard: InterruptGuard, name: str, rc: int | None = None) -> None:
    if guard.requested or rc == EXIT_NOW_CODE:
        why = guard.signal_name or "a signal to the run"
        raise CompareInterrupted(
            f"interrupted at {name} ({why}); a running arm stops after its step and writes a checkpoint",
            hint="run the same command again to continue: finished arms are skipped, the others resume",
        )


def _say(out: TextIO, text: str, end: str = "\n") -> None:
    out.write(text + end)
    out.flush()


# --------------------------------------------------------------------------------------------------------
# The output directory
# --------------------------------------------------------------------------------------------------------


def check_output_dir(plan: ComparePlan, *, overwrite: bool) -> None:
    """Refuse an output directory that holds anything a compare does not write, or (unless ``overwrite``) a
    run directory whose run has another config than the plan's."""
    root = plan.output_dir
    if root.exists() and not root.is_dir():
        raise CompareError(f"--output-dir {root} is a file", hint="choose a directory")
    if not root.is_dir():
        return
    foreign = sorted(child.name for child in root.iterdir() if not _is_compare_entry(child))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise CompareError(
            f"--output-dir {root} holds {shown}, which a compare does not write",
            hint="choose an empty or new --output-dir (a compare writes warm_start/, one directory per arm, "
            "report.md, report.json and plots/)",
        )
    if overwrite:
        return
    runs = [*plan.teachers, *([plan.warm_start] if plan.warm_start else []), *plan.arms]
    for run in runs:
        differences = config_differences(run)
        if differences:
            raise CompareError(
                f"{run.run_dir} holds a run of another configuration ({'; '.join(differences[:4])})",
                hint="pass --overwrite to start the whole comparison over, or choose another --output-dir",
            )


def _is_compare_entry(path: Path) -> bool:
    name = path.name
    if path.is_dir():
        return (
            name in (WARM_START_DIR, TEACHERS_DIR, "plots")
            or bool(ARM_NAME.match(name) or CONFIG_ARM_NAME.match(name))
            or name.startswith(TRASH_PREFIX)
        )
    return name in REPORT_ENTRIES or bool(re.fullmatch(r"\.report\.(md|json)\.tmp", name))


def config_differences(run: PlannedRun) -> list[str]:
    """``key: there → planned`` for each config value the run in ``run.run_dir`` (its ``config.yaml``) has
    otherwise than the plan; [] when there is no run or it matches."""
    written = run.run_dir / "config.yaml"
    if not written.is_file():
        return []
    there = _flatten(_with_current_defaults(yaml.safe_load(written.read_text()) or {}))
    planned = _flatten(run.cfg.resolved_dict())
    keys = sorted(set(there) | set(planned))
    return [
        f"{key}: {there.get(key)!r} → {planned.get(key)!r}"
        for key in keys
        if there.get(key) != planned.get(key)
    ]


def _with_current_defaults(written: dict[str, Any]) -> dict[str, Any]:
    """A run's written config read through this version's schema: a field added since the run was written gets
    its default (a run from before an upgrade is the same run), unless the run's config no longer validates."""
    try:
        return config_from_dict(written).resolved_dict()
    except ConfigError:
        return written


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return {key.removesuffix("."): value for key, value in flat.items()}


def clear_output_dir(root: Path) -> list[str]:
    """Delete what compares wrote into ``root`` (nothing else is there: :func:`check_output_dir` ran); returns
    the names removed. Entries are renamed into one hidden folder first (atomic), then it is deleted."""
    if not root.is_dir():
        return []
    names = sorted(child.name for child in root.iterdir() if _is_compare_entry(child))
    shown = [name for name in names if not name.startswith(TRASH_PREFIX)]
    if names:
        trash = root / f"{TRASH_PREFIX}{os.getpid()}-{time.time_ns()}"
        trash.mkdir()
        for name in names:
            os.rename(root / name, trash / name)
        shutil.rmtree(trash)
    return shown


def _remove_trash(root: Path) -> None:
    """Folders a crash left between renaming entries away and deleting them."""
    for child in root.iterdir():
        if child.is_dir() and child.name.startswith(TRASH_PREFIX):
            shutil.rmtree(child, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------
# Describing the plan
# --------------------------------------------------------------------------------------------------------


def describe(plan: ComparePlan, *, markdown: bool = False) -> list[str]:
    """What the comparison runs, in a few lines (console, or the top of ``report.md``)."""
    arms = [run.arm for run in plan.arms if run.arm is not None]

    def listed(values) -> str:
        return ", ".join(dict.fromkeys(values))

    code = (lambda text: f"`{text}`") if markdown else (lambda text: text)
    seeds = sorted({arm.seed for arm in arms})
    if any(arm.label is not None for arm in arms):
        what = f"configs {listed(code(a.label) for a in arms)}"
    else:
        what = (
            f"losses {listed(a.loss for a in arms)} × replay {listed(a.replay for a in arms)} × "
            f"corrections {listed(a.correction for a in arms)}"
        )
        configurations = dict.fromkeys((a.loss, a.replay, a.correction) for a in arms)
        if len(configurations) < len({a.loss for a in arms}) * len({a.replay for a in arms}) * len(
            {a.correction for a in arms}
        ):  # --configurations: a chosen part of the product
            what = f"configurations {listed(code('-'.join(c)) for c in configurations)}"
    what += "".join(
        f" × {code('+'.join(keys))} {', '.join(':'.join(map(str, value)) for value in values)}"
        for keys, values in plan.grid
    )
    lines = [
        f"{len(arms)} arms: {what} × seeds {listed(map(str, seeds))}, "
        f"{plan.steps} RL steps each, into {code(str(plan.output_dir))}.",
        f"Base config: {plan.source}"
        + (
            f", with {', '.join(code(f'{k}={v}') for k, v in plan.overrides.items())}"
            if plan.overrides
            else ""
        )
        + f"; rollout precision {code(plan.base.rollout.precision)} (trainer: {code(plan.base.precision.dtype)}).",
    ]
    lines += [_teacher_line(run, code) for run in plan.teachers]
    lines.append(_warm_start_line(plan, code))
    if not markdown:
        lines.append(f"each run's log: {plan.output_dir}/<run>/train.log")
    if markdown:
        lines = [line + "  " for line in lines]  # markdown line breaks
    return lines


def _warm_start_line(plan: ComparePlan, code) -> str:
    if plan.warm_start is None:
        return f"No warm start: the config has no SFT phase; every arm starts from model.init={plan.base.model.init}."
    summary = plan.warm_start.run_dir / "summary.json"
    accuracy = ""
    if summary.is_file():
        import json

        value = json.loads(summary.read_text()).get("accuracy_after")
        if isinstance(value, (int, float)):  # on the held-out set of its own seed, not the arms'
            accuracy = f", held-out accuracy {value:.3f} with seed {plan.warm_start.cfg.seed}"
    return (
        f"Warm start: {code(WARM_START_DIR + '/')} ({plan.warm_start.cfg.sft.steps} SFT steps{accuracy}), "
        "the initial weights of every arm (arm seeds are the seed indices)."
    )


def _teacher_line(run: PlannedRun, code) -> str:
    summary = _accuracy_after(run)
    accuracy = f", held-out accuracy {summary:.3f}" if summary is not None else ""
    return (
        f"Teacher {code(run.cfg.name)}: {code(run.name + '/')} ({run.cfg.sft.steps} SFT steps, "
        f"{run.cfg.trainer.steps} RL steps{accuracy}); the arms' teacher {code(run.cfg.name)} scores with its HF export."
    )


def _accuracy_after(run: PlannedRun) -> float | None:
    import json

    path = run.run_dir / "summary.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("accuracy_after")
    return value if isinstance(value, (int, float)) else None
