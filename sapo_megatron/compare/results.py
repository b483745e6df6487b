"""What one arm's run directory says (:class:`ArmResult`) and the arms of each configuration: the shapes that
the report's tables (:mod:`.report`) and its plots (:mod:`.plots`) both read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sapo_megatron.compare.arms import Arm


@dataclass(frozen=True)
class EvalCurve:
    """One eval dataset's headline (``avg@n``) and ``pass@n`` at each evaluation of a run."""

    metric: str
    pass_metric: str | None
    steps: tuple[int, ...]
    values: tuple[float | None, ...]
    pass_values: tuple[float | None, ...]

    def summary(self) -> dict[str, Any]:
        """``arms[i].eval[name]`` of ``report.json``."""
        return {
            "metric": self.metric,
            "before": self.values[0] if self.steps and self.steps[0] == 0 else None,
            "after": self.values[-1] if self.values else None,
            "pass_metric": self.pass_metric,
            "pass_after": self.pass_values[-1] if self.pass_values else None,
        }


@dataclass
class ArmResult:
    """What one arm's run directory says."""

    arm: Arm
    run_dir: Path
    steps: list[int]
    """Logged RL steps, ascending (the last row of each step counts: a resumed run logs a step again)."""
    series: dict[str, list[float | None]]
    """Short name of :data:`METRICS` → value per entry of ``steps`` (``None``: not logged, or not finite), plus
    ``nonfinite``: 1.0 at steps whose loss or gradient norm was logged as null (not finite), else 0.0."""
    summary: dict[str, Any] | None
    """``summary.json``, or ``None`` (unfinished or failed)."""
    failure: str | None = None
    """Why the arm's run failed, when it did (its error line)."""
    evals: dict[str, EvalCurve] = field(default_factory=dict)
    """Eval dataset name → its curve over the run's evaluations (rows of phase ``eval``)."""
    final: dict[str, Any] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    """Why the arm counts as collapsed (empty: it did not)."""

    @property
    def completed_steps(self) -> int:
        """RL steps done: ``summary.json``'s count, else the last logged step (0 before the first)."""
        if self.summary is not None and "steps" in self.summary:
            return int(self.summary["steps"])
        return self.steps[-1] if self.steps else 0

    @property
    def status(self) -> str:
        if self.summary is not None:
            return "finished"
        return "failed" if self.failure else "unfinished"


def by_configuration(results: Sequence[ArmResult]) -> dict[str, list[ArmResult]]:
    """The arms of each configuration (its seeds), in the order the configurations first appear."""
    groups: dict[str, list[ArmResult]] = {}
    for result in results:
        groups.setdefault(result.arm.configuration, []).append(result)
    return groups
