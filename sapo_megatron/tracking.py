"""Logging of a run: TensorBoard scalars, a ``metrics.jsonl`` line per step, and a console progress bar.

Only the main rank writes; other ranks get a tracker whose calls do nothing.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

CONSOLE_KEYS = {
    "reward/mean": "reward",
    "accuracy": "acc",
    "sft/nll": "nll",
    "loss/total": "loss",
    "grad_norm": "gnorm",
    "mismatch/k3": "k3",
}


class Tracker:
    """Writes scalars for one phase of a run (e.g. ``sft`` or ``rl``) under ``output_dir``."""

    def __init__(self, output_dir: str | Path, *, enabled: bool, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self._writer = None
        self._bar: tqdm | None = None
        if enabled:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = (self.output_dir / "metrics.jsonl").open("a")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(str(self.output_dir / "tensorboard"))

    def start_phase(self, name: str, total: int, initial: int = 0) -> None:
        """Open a progress bar for ``total`` steps of phase ``name``."""
        if not self.enabled:
            return
        self.close_phase()
        self._bar = tqdm(
            total=total, initial=initial, desc=name, file=sys.stdout, dynamic_ncols=True, leave=True
        )

    def log(self, step: int, metrics: dict[str, float], *, phase: str) -> None:
        """Record scalars at ``step`` (TensorBoard tag ``phase/name``) and advance the progress bar."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        if self._writer is not None:
            for name, value in clean.items():
                self._writer.add_scalar(f"{phase}/{name}", value, step)
            self._writer.flush()
        self._jsonl.write(json.dumps({"phase": phase, "step": step, **clean}) + "\n")
        self._jsonl.flush()
        if self._bar is not None:
            self._bar.set_postfix(
                {short: f"{clean[k]:.3g}" for k, short in CONSOLE_KEYS.items() if k in clean}
            )
            self._bar.update(1)

    def message(self, text: str) -> None:
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)

    def close_phase(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        if not self.enabled:
            return
        self.close_phase()
        if self._writer is not None:
            self._writer.close()
        self._jsonl.close()


def write_json_atomic(path: str | Path, data: dict[str, Any]) -> Path:
    """Write JSON to a temporary sibling and rename it into place."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path
