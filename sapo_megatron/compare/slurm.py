"""``sapo-megatron compare --slurm``: the same comparison with every run submitted to Slurm instead of run here.

The plan, the checks, the resume rule and the report are :mod:`~sapo_megatron.compare.runner`'s; only the way a
run is started differs. The runs that are not finished go in as ONE array job per stage (the teachers, then the
warm start, then all the arms), task *i* running ``sapo-megatron train <run_dir>/compare.yaml --resume auto`` of
the *i*-th run; this process waits for each array job with a progress line and writes the report at the end.
Run directories must be on a filesystem the nodes share. Each task's stderr goes to ``<run_dir>/slurm-stderr.log``
(its error line is the arm's failure in the report); ``<run_dir>/slurm-job`` names the task, so that a second
compare refuses to start a run whose task still runs.

Signals: SIGINT / SIGTERM / SIGUSR1 cancel the array job (Slurm sends SIGTERM to each task, which checkpoints and
exits); the compare waits for the tasks to end, then stops (exit 130), and the same command continues.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from sapo_megatron.compare.arms import ARM_CONFIG_FILE, CompareError, ComparePlan, PlannedRun
from sapo_megatron.compare.runner import (
    STDERR_TAIL,
    CompareInterrupted,
    CompareOutcome,
    WarmStartError,
    _say,
    _verdict,
    error_line,
    finish,
    is_finished,
    prepare,
)
from sapo_megatron.runtime.interrupts import InterruptGuard

STDERR_FILE = "slurm-stderr.log"
JOB_FILE = "slurm-job"
POLL_S = 5.0
"""How often ``squeue`` is asked; a signal is noticed within :data:`TICK_S` regardless."""
TICK_S = 0.2
STOP_WAIT_S = 120.0
"""After a signal: how long to wait for the cancelled tasks to checkpoint and end."""
COMMAND_TIMEOUT_S = 60
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


class SlurmError(CompareError):
    """Slurm refused or failed a request (sbatch, squeue), or a run of the plan is still running in a job."""


def run_compare_slurm(
    plan: ComparePlan,
    *,
    overwrite: bool = False,
    debug: bool = False,
    sbatch_options: Sequence[str] = (),
    out: TextIO | None = None,
    poll_s: float = POLL_S,
) -> CompareOutcome:
    """Run what is not finished as Slurm array jobs, stage by stage, and write the report; see the module
    docstring. Raises like :func:`~sapo_megatron.compare.runner.run_compare`, and :class:`SlurmError`."""
    out = out or sys.stdout
    if shutil.which("sbatch") is None or shutil.which("squeue") is None:
        raise SlurmError("--slurm: sbatch / squeue not found on PATH", hint="run on a Slurm login node")
    prepare(plan, overwrite=overwrite, out=out)
    stages = [("teachers", plan.teachers), ("warm start", [plan.warm_start] if plan.warm_start else [])]
    ran: list[str] = []
    with InterruptGuard(announce=None) as guard:
        for what, runs in stages:
            failures = _stage(what, runs, guard, out, ran, list(sbatch_options), debug, poll_s)
            if failures:
                name, error = next(iter(failures.items()))
                raise WarmStartError(
                    f"the {what} failed ({name}): {error}",
                    hint="see its train.log and slurm-stderr.log; run the same command again once fixed",
                )
        failures = _stage("arms", plan.arms, guard, out, ran, list(sbatch_options), debug, poll_s)
    return finish(plan, failures, ran, out)


def _stage(
    what: str,
    runs: Sequence[PlannedRun],
    guard: InterruptGuard,
    out: TextIO,
    ran: list[str],
    options: list[str],
    debug: bool,
    poll_s: float,
) -> dict[str, str]:
    """Submit the unfinished ``runs`` as one array job, wait for it; returns run name → error of those that
    did not finish."""
    todo = []
    for run in runs:
        if is_finished(run):
            _say(
                out,
                f"{run.name} finished earlier" + (f": {_verdict(run.arm, run.run_dir)}" if run.arm else ""),
            )
        else:
            todo.append(run)
    if not todo:
        return {}
    _refuse_running(todo)
    job = submit_array(todo, options, debug=debug)
    ran.extend(run.name for run in todo)
    _say(out, f"{what}: Slurm array job {job}, {len(todo)} task(s): {', '.join(run.name for run in todo)}")
    _wait(job, len(todo), guard, out, poll_s, what)
    failures = {}
    for index, run in enumerate(todo):
        if is_finished(run):
            _say(
                out,
                f"{run.name} ({job}_{index}) done"
                + (f": {_verdict(run.arm, run.run_dir)}" if run.arm else ""),
            )
            continue
        failures[run.name] = _task_error(run) or f"task {job}_{index} ended without summary.json"
        _say(
            out, f"{run.name} ({job}_{index}) failed: {failures[run.name]}; log: {run.run_dir / 'train.log'}"
        )
    return failures


def submit_array(runs: list[PlannedRun], options: list[str], *, debug: bool = False) -> str:
    """``sbatch --array=0-(N-1)``: task *i* trains ``runs[i]`` from its resolved config; returns the job id."""
    configs = []
    for run in runs:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        configs.append(run.cfg.save_resolved(run.run_dir / ARM_CONFIG_FILE).resolve())
        (run.run_dir / STDERR_FILE).unlink(missing_ok=True)  # an earlier attempt's error is not this one's
    train = shlex.join([sys.executable, "-m", "sapo_megatron.cli", "train"])
    train += ' "$1" --resume auto' + (" --debug" if debug else "")
    # stdout (progress bars) is dropped as in the local runner: train.log in the run directory keeps the log.
    script = (
        f"set -- {shlex.join(str(path) for path in configs)}; shift $SLURM_ARRAY_TASK_ID; "
        f'exec {train} > /dev/null 2> "$(dirname "$1")/{STDERR_FILE}"'
    )
    command = ["sbatch", "--parsable", "--job-name=sapo-compare", f"--array=0-{len(runs) - 1}"]
    command += ["--output=/dev/null", *options, f"--wrap={script}"]
    done = _slurm(command)
    job = done.strip().split(";")[0]
    for index, run in enumerate(runs):
        (run.run_dir / JOB_FILE).write_text(f"{job}_{index}\n")
    return job


def task_states(job: str) -> dict[int, str]:
    """Array task index → Slurm state of the tasks ``squeue`` still knows (one line per task: ``-r``)."""
    lines = _slurm(["squeue", "-h", "-r", "-t", "all", "-j", job, "-o", "%K %T"], allow_unknown=True)
    states = {}
    for line in lines.splitlines():
        index, _, state = line.strip().partition(" ")
        if index.isdigit():
            states[int(index)] = state
    return states


def _wait(job: str, count: int, guard: InterruptGuard, out: TextIO, poll_s: float, what: str) -> None:
    """Until no task of ``job`` is active; print a line whenever the counts change. A signal cancels the job."""
    started = time.monotonic()
    shown = ""
    while True:
        states = task_states(job)
        active = [state for state in states.values() if state in ACTIVE_STATES]
        if not active:
            return
        running = sum(state == "RUNNING" for state in active)
        line = f"{what}: job {job}: {running} running, {len(active) - running} waiting, {count - len(active)} of {count} ended"
        if line != shown:
            _say(out, f"{line} ({time.monotonic() - started:.0f} s)")
            shown = line
        deadline = time.monotonic() + poll_s
        while time.monotonic() < deadline:
            if guard.requested:
                _cancel(job, out)
                raise CompareInterrupted(
                    f"interrupted ({guard.signal_name}); cancelled Slurm job {job}, its runs wrote checkpoints",
                    hint="run the same command again to continue: finished arms are skipped, the others resume",
                )
            time.sleep(TICK_S)


def _cancel(job: str, out: TextIO) -> None:
    _say(out, f"cancelling Slurm job {job} (its tasks checkpoint on SIGTERM) ...")
    _slurm(["scancel", job])
    deadline = time.monotonic() + STOP_WAIT_S
    while any(state in ACTIVE_STATES for state in task_states(job).values()):
        if time.monotonic() > deadline:
            _say(out, f"job {job} still ends after {STOP_WAIT_S:.0f} s; check squeue before running again")
            return
        time.sleep(1.0)


def _refuse_running(runs: list[PlannedRun]) -> None:
    """A run whose task (of an earlier compare that was killed) still runs would get two trainers."""
    for run in runs:
        marker = run.run_dir / JOB_FILE
        if not marker.is_file():
            continue
        task = marker.read_text().strip()
        job, _, index = task.partition("_")
        state = task_states(job).get(int(index)) if index.isdigit() else None
        if state in ACTIVE_STATES:
            raise SlurmError(
                f"{run.name} is still {state} in Slurm task {task} of an earlier compare",
                hint=f"wait for it to end (squeue -j {job}) or cancel it (scancel {job}), then run again",
            )


def _task_error(run: PlannedRun) -> str:
    path = run.run_dir / STDERR_FILE
    if not path.is_file():
        return ""
    text = path.read_text(errors="replace")
    return error_line(text[-STDERR_TAIL:])


def _slurm(command: list[str], *, allow_unknown: bool = False) -> str:
    """Run a Slurm command; its stdout. ``allow_unknown``: a job Slurm already forgot reads as no lines."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SlurmError(f"{command[0]}: {error}") from None
    if done.returncode != 0:
        if allow_unknown and "Invalid job id" in done.stderr:
            return ""
        raise SlurmError(f"{shlex.join(command[:3])} ... failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def sbatch_options(text: str | None) -> list[str]:
    """``--sbatch="--partition=gpu --time=4:00:00"`` as a list of options; each must be an option."""
    options = shlex.split(text or "")
    bad = [option for option in options if not option.startswith("-")]
    if bad:
        raise SlurmError(
            f"--sbatch {text!r}: {bad[0]!r} is not an sbatch option",
            hint='write options with their values joined: --sbatch="--partition=gpu --time=4:00:00"',
        )
    return options
