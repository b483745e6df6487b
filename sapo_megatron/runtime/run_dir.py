"""The output-directory policy of ``sapo-megatron train``: start, continue or replace a run, never by accident.

What a run writes into its output directory (and nothing else is ever moved or deleted here):

- ``config.yaml``, ``metrics.jsonl``, ``summary.json``, ``tensorboard/``, ``rollout_weights/``,
  ``reference_policy/``, ``checkpoints/``, ``hf/`` (:data:`RUN_ENTRIES`), plus the temporary names their
  atomic writers use (``config.yaml.tmp``, ``.hf.partial``, ...);
- ``train.log``, the full log: appended by every start and never deleted, so it is not part of a run's state.

A directory **holds a run** once that run made progress: a row in ``metrics.jsonl``, anything in
``checkpoints/``, ``reference_policy/``, ``hf/`` or ``summary.json``. What a start writes before its first
step (``config.yaml``, an empty ``metrics.jsonl``, ``tensorboard/``, ``rollout_weights/``) is a *failed start*
when nothing else is there: it is no run, and the next start removes it (saying so in one line). Files that a
run does not write (a README, a SLURM ``.out`` file) never count and are never touched.

:func:`prepare_run_dir` applies one of four modes, on the main rank, before anything is written:

============  ========================================================================================
``new``       no run there: start (removing a failed start's leftovers); a run there: refuse, naming
              ``--resume`` and ``--overwrite``, and leave the directory untouched.
``resume``    continue from the newest complete checkpoint; without one, refuse and say what is there.
``auto``      ``resume`` when a complete checkpoint exists, else start fresh (what SLURM requeues use);
              an unfinished run without checkpoint is started over (one line says so); a finished run
              without checkpoint is refused.
``overwrite`` delete what a run writes (``train.log`` and unrelated files stay), then start fresh.
============  ========================================================================================

Deletion is crash-safe: the entries are first renamed into one hidden ``.sapo-removed-*`` folder inside the
run directory (atomic, same filesystem), which is then deleted; a folder left by a crash in between is removed
by the next start.

:func:`cleanup_failed_start` wraps a run: if a fresh start fails before its first logged step or checkpoint,
what it created is removed again (``train.log`` stays, with the failure's traceback).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sapo_megatron.checkpoint import atomic
from sapo_megatron.errors import UserError

Mode = Literal["new", "resume", "auto", "overwrite"]
MODES: tuple[str, ...] = ("new", "resume", "auto", "overwrite")

PROGRESS_ENTRIES = ("checkpoints", "reference_policy", "hf", "summary.json")
"""Entries whose presence means a run got past its first step (``metrics.jsonl`` counts when non-empty)."""

START_ENTRIES = ("config.yaml", "metrics.jsonl", "tensorboard", "rollout_weights", "wandb")
"""Entries a start writes before its first step."""

RUN_ENTRIES = START_ENTRIES + PROGRESS_ENTRIES
"""Everything a run writes into its output directory, besides ``train.log``."""

LOG_FILE = "train.log"
TRASH_PREFIX = ".sapo-removed-"


class RunDirError(UserError):
    """The output directory does not allow the requested start (a run is there, or nothing to resume)."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete training-state checkpoint of a run."""

    path: Path
    extra: dict[str, Any]
    """The ``extra`` its completion marker holds (the trainer's loop state: ``step``, ``sft_step``, ...)."""

    @property
    def steps(self) -> dict[str, int]:
        """Completed steps per phase: ``{"sft": sft_step, "rl": step}`` (0 for a phase not reached)."""
        return {"sft": int(self.extra.get("sft_step", 0)), "rl": int(self.extra.get("step", 0))}


@dataclass(frozen=True)
class RunStart:
    """How a run starts in ``run_dir`` (the result of :func:`prepare_run_dir`; picklable, to broadcast)."""

    run_dir: Path
    mode: str
    checkpoint: Checkpoint | None
    """The checkpoint to continue from; ``None`` for a fresh start."""
    note: str | None = None
    """One line to show the user (what was removed, what is resumed), or ``None``."""

    @property
    def resume(self) -> bool:
        return self.checkpoint is not None

    @property
    def resume_at(self) -> dict[str, int] | None:
        """Phase → last completed step of the checkpoint (for ``Tracker(resume_at=...)``); ``None`` if fresh."""
        if self.checkpoint is None:
            return None
        steps = self.checkpoint.steps
        # Evaluations at RL step k are logged before step k's checkpoint, except the one before RL (step 0),
        # which follows the end-of-SFT checkpoint: resuming from there evaluates again.
        return {**steps, "eval": steps["rl"] if steps["rl"] > 0 else -1}


@dataclass(frozen=True)
class RunState:
    """What an output directory holds (see :func:`inspect_run_dir`)."""

    run_dir: Path
    entries: tuple[str, ...]
    """Run entries present (names from :data:`RUN_ENTRIES` and their temporary names)."""
    metrics_rows: dict[str, int]
    """Rows per phase in ``metrics.jsonl``."""
    last_steps: dict[str, int]
    """Highest logged step per phase."""
    checkpoint: Checkpoint | None
    checkpoint_note: str | None
    """Why ``checkpoint`` is not the one ``latest`` names, or what is incomplete; ``None`` if nothing to say."""

    @property
    def holds_run(self) -> bool:
        """The directory holds a run that made progress (see the module docstring)."""
        return bool(sum(self.metrics_rows.values())) or any(name in self.entries for name in PROGRESS_ENTRIES)

    @property
    def finished(self) -> bool:
        return "summary.json" in self.entries

    def describe(self) -> str:
        """What is there, in a few words: ``config.yaml, metrics.jsonl (rl up to step 48), checkpoints/``."""
        parts = []
        for name in self.entries:
            label = f"{name}/" if (self.run_dir / name).is_dir() else name
            if name == "metrics.jsonl" and self.last_steps:
                logged = ", ".join(f"{phase} up to step {step}" for phase, step in self.last_steps.items())
                label += f" ({logged})"
            parts.append(label)
        return ", ".join(parts) or "nothing of a run"


def prepare_run_dir(path: str | Path, *, mode: str) -> RunStart:
    """Apply ``mode`` (``new``/``resume``/``auto``/``overwrite``) to the output directory ``path``.

    Call it on the main rank before anything of the run is written; it creates ``path`` when the run may start.
    Raises :class:`RunDirError` (the directory is then left exactly as it was) when it may not.
    """
    state = check_run_dir(path, mode=mode)
    if mode == "resume" or (mode == "auto" and state.checkpoint is not None):
        return _resume(state, mode)
    return _fresh(state, mode)


def check_run_dir(path: str | Path, *, mode: str) -> RunState:
    """The refusals of :func:`prepare_run_dir` alone: raises the same :class:`RunDirError`, writes nothing.

    The command line calls it before torch is imported, so that a refused start answers in about a second.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    run_dir = Path(path)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"output directory {run_dir} is a file", hint="choose another --output-dir")
    state = inspect_run_dir(run_dir)
    if mode == "resume" or (mode == "auto" and state.checkpoint is not None):
        if state.checkpoint is None:
            raise _nothing_to_resume(state)
    elif mode == "new" and state.holds_run:
        raise _refusal(state)
    elif mode == "auto" and _damaged_checkpoints(run_dir / "checkpoints"):
        raise _nothing_to_resume(state)  # never start over on top of checkpoints that might be restored
    elif mode == "auto" and state.finished:
        raise RunDirError(
            f"{run_dir} holds a finished run without a checkpoint ({state.describe()}); "
            "--resume auto does not start it over",
            hint="pass --overwrite to replace it, or choose another --output-dir",
        )
    return state


def _resume(state: RunState, mode: str) -> RunStart:
    assert state.checkpoint is not None  # check_run_dir refused the start otherwise
    notes = [f"resuming from {state.checkpoint.path.name} ({_steps_text(state.checkpoint.steps)})"]
    if state.checkpoint_note:
        notes.insert(0, state.checkpoint_note)
    return RunStart(state.run_dir, mode, state.checkpoint, note="; ".join(notes))


def _fresh(state: RunState, mode: str) -> RunStart:
    note = None
    if state.entries:
        what = state.describe()
        remove_run_entries(state.run_dir)
        if mode == "overwrite":
            note = f"removed the previous run in {state.run_dir} ({what})"
        elif state.holds_run:
            note = f"{state.run_dir} held an unfinished run without a checkpoint ({what}): starting over"
        else:
            note = f"removed the leftovers of a start that never reached its first step ({what})"
    state.run_dir.mkdir(parents=True, exist_ok=True)
    return RunStart(state.run_dir, mode, None, note=note)


def _refusal(state: RunState) -> RunDirError:
    if state.checkpoint is not None:
        what = f"{state.describe()}; newest checkpoint {state.checkpoint.path.name}"
        hint = "continue it with --resume, replace it with --overwrite, or choose another --output-dir"
    else:
        what = f"{state.describe()}; no checkpoint"
        hint = (
            "it has no checkpoint for --resume to continue from: replace it with --overwrite, "
            "or choose another --output-dir"
        )
    return RunDirError(f"{state.run_dir} already holds a run ({what})", hint=hint)


def _nothing_to_resume(state: RunState) -> RunDirError:
    run_dir = state.run_dir
    if not state.entries:
        return RunDirError(
            f"nothing to resume: {run_dir} holds no run",
            hint="start a new run without --resume (--resume auto does either)",
        )
    detail = f" ({state.checkpoint_note})" if state.checkpoint_note else ""
    damaged = _damaged_checkpoints(run_dir / "checkpoints")
    if damaged:
        return RunDirError(
            f"no complete checkpoint in {run_dir}: all {len(damaged)} checkpoint(s) there are damaged "
            f"({', '.join(damaged[:3])}{', ...' if len(damaged) > 3 else ''}){detail}",
            hint="restore a checkpoint from a backup, or start the run again with --overwrite",
        )
    if state.holds_run:
        return RunDirError(
            f"no checkpoint in {run_dir}{detail}: the run stopped before its first checkpoint; "
            f"there is {state.describe()}",
            hint="start it again with --overwrite (or --resume auto)",
        )
    return RunDirError(
        f"no checkpoint in {run_dir}: the run stopped before its first step ({state.describe()})",
        hint="start it again without --resume",
    )


def _damaged_checkpoints(root: Path) -> list[str]:
    """Names of the checkpoint directories in ``root`` that a save finished writing (their marker is there)
    but that fail the completeness check now (a truncated or missing file)."""
    if not root.is_dir():
        return []
    damaged = []
    for child in sorted(root.iterdir()):
        if child.is_dir() and (child / atomic.MARKER).exists():
            try:
                atomic.read_marker(child)
            except atomic.IncompleteCheckpointError:
                damaged.append(child.name)
    return damaged


def _steps_text(steps: dict[str, int]) -> str:
    return ", ".join(f"{phase} step {step}" for phase, step in steps.items())


# --------------------------------------------------------------------------------------------------------
# Reading a run directory
# --------------------------------------------------------------------------------------------------------


def inspect_run_dir(path: str | Path) -> RunState:
    """What the output directory ``path`` holds (it need not exist); reads, never writes."""
    run_dir = Path(path)
    entries = tuple(name for name in _present_entries(run_dir))
    rows, last = _metrics_summary(run_dir / "metrics.jsonl")
    checkpoint, note = find_checkpoint(run_dir / "checkpoints")
    return RunState(run_dir, entries, rows, last, checkpoint, note)


def _present_entries(run_dir: Path) -> list[str]:
    """Run entries and their atomic writers' temporary names present in ``run_dir``, in a stable order."""
    if not run_dir.is_dir():
        return []
    names = {child.name for child in run_dir.iterdir()}
    found = []
    for name in RUN_ENTRIES:
        candidates = [name, f"{name}.tmp", f".{name}.tmp", f".{name}.partial"]
        found += [c for c in candidates if c in names]
        found += sorted(n for n in names if n.startswith(f".{name}.replaced-"))
    found += sorted(n for n in names if n.startswith(TRASH_PREFIX))
    return found


def _metrics_summary(path: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(rows per phase, highest step per phase) of a ``metrics.jsonl``; unreadable lines are skipped."""
    rows: dict[str, int] = {}
    last: dict[str, int] = {}
    if not path.is_file():
        return rows, last
    with path.open() as handle:
        for line in handle:
            try:
                row = json.loads(line)
                phase, step = str(row["phase"]), int(row["step"])
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a crash
            rows[phase] = rows.get(phase, 0) + 1
            last[phase] = max(last.get(phase, step), step)
    return rows, last


def find_checkpoint(root: str | Path) -> tuple[Checkpoint | None, str | None]:
    """The checkpoint a resume continues from, in ``root`` (a run's ``checkpoints/``), and a note.

    The one ``root/latest`` names when it is a complete training state (the normal case, note ``None``);
    otherwise the newest complete training state by creation time, with a note saying why. Without any
    complete training state: ``(None, note)`` describing what is there (``None`` when nothing is).
    """
    root = Path(root)
    if not root.is_dir():
        return None, None
    problem = None
    if (root / atomic.LATEST).is_file():
        try:
            path = atomic.resolve_checkpoint(root)
            return Checkpoint(path, _train_state_extra(path)), None
        except atomic.IncompleteCheckpointError as err:
            problem = f"checkpoints/latest does not name a complete checkpoint: {err}"
    complete = _complete_train_states(root)
    if complete:
        newest = complete[-1]
        note = problem or f"checkpoints/latest is missing; using the newest complete checkpoint {newest.name}"
        return Checkpoint(newest, _train_state_extra(newest)), note
    if problem is None:
        partial = sorted(child.name for child in root.iterdir() if child.name.endswith(".partial"))
        if partial:
            problem = f"checkpoints/ holds only interrupted saves ({', '.join(partial)})"
    return None, problem


def _train_state_extra(path: Path) -> dict[str, Any]:
    marker = atomic.read_marker(path)
    if marker.get("kind") != "train_state":
        raise atomic.IncompleteCheckpointError(f"{path} holds {marker.get('kind')!r}, not a training state")
    return dict(marker.get("extra", {}))


def _complete_train_states(root: Path) -> list[Path]:
    """Complete training-state checkpoints in ``root``, oldest first (by their marker's creation time)."""
    found = []
    for child in root.iterdir():
        if not child.is_dir() or child.name.startswith("."):
            continue
        try:
            marker = atomic.read_marker(child)
        except atomic.IncompleteCheckpointError:
            continue
        if marker.get("kind") == "train_state":
            found.append((marker.get("created_unix", 0.0), child.name, child))
    return [path for _, _, path in sorted(found)]


# --------------------------------------------------------------------------------------------------------
# Removing what a run wrote
# --------------------------------------------------------------------------------------------------------


def remove_run_entries(run_dir: str | Path, names: tuple[str, ...] | None = None) -> list[str]:
    """Delete the run entries ``names`` (default: all present) from ``run_dir``; returns the names removed.

    Only run entries are ever touched (``train.log`` and unrelated files stay). The entries are first renamed
    into one hidden ``.sapo-removed-*`` folder (atomic), then that folder is deleted, so a crash leaves either
    the entry or a folder the next start removes.
    """
    run_dir = Path(run_dir)
    present = _present_entries(run_dir)
    chosen = [name for name in present if names is None or name in names]
    if not chosen:
        return []
    trash = run_dir / f"{TRASH_PREFIX}{os.getpid()}-{time.time_ns()}"
    trash.mkdir()
    for name in chosen:
        os.rename(run_dir / name, trash / name)
    shutil.rmtree(trash)
    return chosen


@contextlib.contextmanager
def cleanup_failed_start(start: RunStart, *, enabled: bool = True) -> Iterator[None]:
    """Remove what a fresh start created if the block fails before the run logged a step or wrote a checkpoint.

    A failure after that keeps everything (the next start resumes, or is refused and told what to do). A resumed
    run's failure removes nothing: its directory holds the run it continues, and the next start resumes again.
    ``train.log`` always stays. Around everything after :func:`start_run`; it acts where ``enabled`` (pass
    ``is_main``: only the main rank cleans up).
    """
    try:
        yield
    except BaseException:
        if enabled and not start.resume and not made_progress(start.run_dir):
            with contextlib.suppress(OSError):  # never hide the run's own error behind a cleanup error
                remove_run_entries(start.run_dir)
        raise


def made_progress(run_dir: str | Path) -> bool:
    """Whether a freshly started run logged a step or wrote a checkpoint."""
    state = inspect_run_dir(run_dir)
    return state.checkpoint is not None or bool(sum(state.metrics_rows.values()))


# --------------------------------------------------------------------------------------------------------
# All ranks
# --------------------------------------------------------------------------------------------------------


def start_run(
    path: str | Path, *, mode: str, is_main: bool, announce: Callable[[str], None] | None = print
) -> RunStart:
    """Every rank, once the process group exists and before anything of the run is written.

    The main rank applies :func:`prepare_run_dir`, sends ``train.log`` to the run directory
    (:func:`logs.attach_run_log`) and announces the start's note; the outcome is broadcast, so every rank
    returns the same :class:`RunStart` or raises the same :class:`RunDirError` (only the main rank's CLI prints
    it). Without an initialized process group (one process) there is nothing to broadcast.
    """
    outcome: RunStart | RunDirError | None = None
    if is_main:
        try:
            outcome = prepare_run_dir(path, mode=mode)
        except RunDirError as err:
            outcome = err
    outcome = _broadcast_from_main(outcome)
    if isinstance(outcome, RunDirError):
        raise outcome
    if is_main:
        from sapo_megatron.runtime import logs

        logs.attach_run_log(outcome.run_dir / LOG_FILE, header=f"sapo-megatron train: {_start_text(outcome)}")
        if outcome.note and announce is not None:
            announce(outcome.note)
    return outcome


def _start_text(start: RunStart) -> str:
    if start.checkpoint is None:
        return f"mode {start.mode}, fresh start"
    return f"mode {start.mode}, resuming from {start.checkpoint.path.name} ({_steps_text(start.checkpoint.steps)})"


def _broadcast_from_main(obj: Any) -> Any:
    """``obj`` of rank 0 on every rank (identity without an initialized multi-rank process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --------------------------------------------------------------------------------------------------------
# Output directories of the other commands that write (eval)
# --------------------------------------------------------------------------------------------------------

COMMAND_OUTPUTS: dict[str, tuple[str, ...]] = {
    "eval": ("eval.json", "samples.jsonl", "hf_model"),
    "compare": ("report.json", "report.md", "plots", "warm_start"),
}
"""What each command other than ``train`` writes into its ``--output-dir`` (a marker file first)."""


def owning_run(path: str | Path) -> Path | None:
    """The training run directory strictly above ``path`` (links resolved), if there is one: a folder with a
    run's ``metrics.jsonl`` or ``checkpoints/``."""
    resolved = Path(os.path.realpath(path))
    for parent in resolved.parents:
        if (parent / "metrics.jsonl").is_file() or (parent / "checkpoints").is_dir():
            return parent
    return None


def check_command_output_dir(path: str | Path, *, command: str, overwrite: bool) -> None:
    """Refuse ``path`` as ``command``'s ``--output-dir`` when it holds a run or another command's outputs.

    ``command``'s own earlier outputs (its marker file, e.g. ``eval.json``, is there) are replaced: that is the
    same command run again. Anything of a training run (``samples.jsonl`` of a run included) or of another
    command is left alone unless ``overwrite`` says otherwise; files no command writes never count.
    Call it before any work, so a refusal costs nothing.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--output-dir {out} is a file", hint="choose a directory")
    run = owning_run(out)
    if run is not None:  # never, whatever --overwrite says: the run's own files (report/, eval/) live there
        raise RunDirError(
            f"--output-dir {out} is inside the training run {run}; {command} never writes into a run it does not own",
            hint=f"choose a folder outside the run (e.g. {run.parent / (run.name + '-' + command)})",
        )
    if overwrite or not out.is_dir():
        return
    state = inspect_run_dir(out)
    if state.entries:
        raise RunDirError(
            f"--output-dir {out} holds a training run ({state.describe()}); {command} would overwrite its files",
            hint=f"choose another --output-dir (e.g. {out / command}), or pass --overwrite",
        )
    own = COMMAND_OUTPUTS[command]
    names = {child.name for child in out.iterdir()}
    foreign = sorted(
        name
        for other, outputs in COMMAND_OUTPUTS.items()
        if other != command
        for name in outputs
        if name in names and name not in own
    )
    if own[0] not in names:
        foreign += sorted(name for name in own[1:] if name in names)
    if foreign:
        raise RunDirError(
            f"--output-dir {out} holds outputs that {command} did not write ({', '.join(foreign)})",
            hint=f"choose another --output-dir (e.g. {out / command}), or pass --overwrite",
        )
