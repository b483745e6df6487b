"""``sapo-megatron compare``: the same RL run under several policy losses, routing-replay modes, mismatch
corrections and seeds, from one shared warm start, with a report (table, plots, automatic reading).

- :mod:`~sapo_megatron.compare.arms`: which arms, and each arm's exact config (no training);
- :mod:`~sapo_megatron.compare.runner`: runs the warm start and the arms one after another, resumable;
- :mod:`~sapo_megatron.compare.report` / :mod:`~sapo_megatron.compare.plots`: ``report.json``, ``report.md`` and
  the PNGs, from the arms' ``metrics.jsonl`` and ``summary.json``.

See docs/compare.md.
"""

from sapo_megatron.compare.arms import (
    CORRECTIONS,
    LOSSES,
    REPLAYS,
    Arm,
    CompareError,
    ComparePlan,
    PlannedRun,
    build_config_plan,
    build_plan,
    grid_points,
    parse_configurations,
    parse_grid,
    parse_names,
    plan_arms,
)
from sapo_megatron.compare.report import COLLAPSE_RULE, ArmResult, load_arm_result, report_json, write_report
from sapo_megatron.compare.runner import CompareInterrupted, CompareOutcome, WarmStartError, run_compare

__all__ = [
    "COLLAPSE_RULE",
    "CORRECTIONS",
    "LOSSES",
    "REPLAYS",
    "Arm",
    "ArmResult",
    "CompareError",
    "CompareInterrupted",
    "CompareOutcome",
    "ComparePlan",
    "PlannedRun",
    "WarmStartError",
    "build_config_plan",
    "build_plan",
    "grid_points",
    "load_arm_result",
    "parse_configurations",
    "parse_grid",
    "parse_names",
    "plan_arms",
    "report_json",
    "run_compare",
    "write_report",
]
