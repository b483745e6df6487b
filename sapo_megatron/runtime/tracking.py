"""Logging of a run: TensorBoard scalars, a ``metrics.jsonl`` line per logged step, and a console progress bar.

Layout and names:

- ``metrics.jsonl``: one JSON object per logged step, ``{"phase": "rl", "step": 12, "<metric>": value, ...}``.
  A non-finite value (NaN, ±inf) is written as ``null`` (JSON has neither), never dropped; the tracker counts
  such rows per phase (:attr:`Tracker.nonfinite_rows`) and :meth:`Tracker.log` returns the names.
- ``tensorboard/<phase>/``: one event writer per phase (``sft``, ``rl``), shown by TensorBoard as one run per
  phase. A scalar's tag is the metric's name exactly as in ``metrics.jsonl`` (``sft/nll``, ``reward/mean``,
  ``grad_norm``); the phase is the run, never a tag prefix.
- Resuming (``resume_at``: phase → last step the checkpoint completed) rewrites ``metrics.jsonl`` without the
  rows after the checkpoint and opens each phase's writer with ``purge_step`` = that step + 1, which makes
  TensorBoard discard the older events from there on: every (phase, step) appears once.
- The progress bar of a phase shows steps: :meth:`Tracker.log` moves it to ``step``, however often a phase logs.

Only the main rank writes; other ranks get a tracker whose calls do nothing.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from sapo_megatron import jsonio

CONSOLE_KEYS = {
    "reward/mean": "reward",
    "accuracy": "acc",
    "eval_score": "eval",
    "sft/nll": "nll",
    "loss/total": "loss",
    "grad_norm": "gnorm",
    "mismatch/k3": "k3",
}

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class Tracker:
    """Writes the scalars of a run's phases (``sft``, ``rl``) under ``output_dir``; see the module docstring.

    ``resume_at`` (phase → last completed step of the checkpoint a run resumes from, e.g. ``{"sft": 400,
    "rl": 200}``) truncates what was logged after it; ``None`` for a fresh run (``metrics.jsonl`` is appended).
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        enabled: bool,
        tensorboard: bool = True,
        resume_at: Mapping[str, int] | None = None,
        sink: Any = None,
    ) -> None:
        self.enabled = enabled
        self.sink = sink
        """Another tracker fed the same rows (:class:`~sapo_megatron.runtime.wandb_tracking.WandbSink`), or None."""
        self.output_dir = Path(output_dir)
        self.tensorboard = tensorboard
        self.resume_at = dict(resume_at or {})
        self.nonfinite_rows: dict[str, int] = {}
        """Phase → logged rows that held a non-finite value."""
        self._writers: dict[str, Any] = {}
        self._writers_lock = threading.Lock()  # samples' text may come from the async rollout thread
        self._bar: tqdm | None = None
        self._bar_phase: str | None = None
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if resume_at is not None:
            truncate_metrics(self.output_dir / METRICS_FILE, self.resume_at)
            for phase in self.resume_at:  # purge now, so TensorBoard agrees with metrics.jsonl from the start
                if tensorboard and (self.output_dir / TENSORBOARD_DIR / phase).is_dir():
                    self._writer(phase)
        self._jsonl = (self.output_dir / METRICS_FILE).open("a")

    def start_phase(self, name: str, total: int, initial: int = 0) -> None:
        """Open the progress bar of phase ``name``: ``total`` steps, ``initial`` of them done (a resume)."""
        if not self.enabled:
            return
        self.close_phase()
        self._bar_phase = name
        self._bar = tqdm(
            total=total, initial=initial, desc=name, file=sys.stdout, dynamic_ncols=True, leave=True
        )

    def log(self, step: int, metrics: Mapping[str, Any], *, phase: str) -> list[str]:
        """Record the scalars of ``phase`` at ``step``; returns the names whose value is not finite.

        Values are numbers (Python, NumPy or 0-d tensors); ``None`` means "no value" and is written as null.
        """
        if not self.enabled:
            return []
        values = {name: _as_float(name, value) for name, value in metrics.items()}
        nonfinite = [name for name, value in values.items() if value is not None and not math.isfinite(value)]
        if nonfinite:
            self.nonfinite_rows[phase] = self.nonfinite_rows.get(phase, 0) + 1
        self._write_tensorboard(phase, step, values)
        row = {"phase": phase, "step": step}
        row.update({name: _json_value(value) for name, value in values.items()})
        self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
        self._jsonl.flush()
        if self.sink is not None:
            self.sink.log(phase, step, {name: value for name, value in values.items() if _finite(value)})
        if self._bar is not None and self._bar_phase == phase:
            self._bar.set_postfix(
                {short: f"{values[k]:.3g}" for k, short in CONSOLE_KEYS.items() if values.get(k) is not None}
            )
            self._bar.update(step - self._bar.n)  # the bar counts steps, not calls
        return nonfinite

    def text(self, phase: str, tag: str, text: str, step: int) -> None:
        """A text entry in TensorBoard (e.g. generated samples); nothing in ``metrics.jsonl``."""
        if self.enabled and self.tensorboard:
            writer = self._writer(phase)
            writer.add_text(tag, text, step)
            writer.flush()

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Generated samples of RL ``step`` (``samples.jsonl``'s rows) for the trackers that keep tables."""
        if self.enabled and self.sink is not None:
            self.sink.samples(step, rows)

    def message(self, text: str) -> None:
        """Print a line on the console without breaking the progress bar."""
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)

    def close_phase(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            self._bar_phase = None

    def close(self) -> None:
        if not self.enabled:
            return
        self.close_phase()
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        self._jsonl.close()
        if self.sink is not None:
            self.sink.finish()
            self.sink = None

    def _writer(self, phase: str):
        """The phase's TensorBoard writer, created on first use (with the resume's purge step)."""
        with self._writers_lock:
            if phase not in self._writers:
                from torch.utils.tensorboard import SummaryWriter

                purge_step = self.resume_at[phase] + 1 if phase in self.resume_at else None
                log_dir = self.output_dir / TENSORBOARD_DIR / phase
                self._writers[phase] = SummaryWriter(str(log_dir), purge_step=purge_step)
            return self._writers[phase]

    def _write_tensorboard(self, phase: str, step: int, values: Mapping[str, float | None]) -> None:
        if not self.tensorboard:
            return
        writer = self._writer(phase)
        for name, value in values.items():
            if value is not None:
                writer.add_scalar(name, value, step)
        writer.flush()


def truncate_metrics(path: str | Path, resume_at: Mapping[str, int]) -> int:
    """Drop the rows of ``metrics.jsonl`` logged after a checkpoint: for each phase in ``resume_at``, those with
    ``step`` greater than its value (other phases' rows stay), plus lines torn by a crash. Rewrites the file
    atomically (temporary file + fsync + rename) only when something goes; returns the number of lines dropped.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    with path.open() as handle:
        for line in handle:
            try:
                row = json.loads(line)
                keep = row["step"] <= resume_at.get(row["phase"], math.inf)
            except (ValueError, KeyError, TypeError):
                keep = False
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("w") as handle:
            handle.writelines(kept)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    return dropped


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _as_float(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # a 0-d torch tensor or NumPy array
        return float(value.item())
    raise TypeError(f"metric {name!r}: expected a number, got {type(value).__name__} {value!r}")


def _json_value(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def write_json_atomic(path: str | Path, data: dict[str, Any]) -> Path:
    """Write JSON to a temporary sibling and rename it into place."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(jsonio.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path
