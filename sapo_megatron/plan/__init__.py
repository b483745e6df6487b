"""The planner: per-rank parameters, static memory, activation memory and a fits / does-not-fit verdict for a
parallel layout (``sapo-megatron plan``, ``train --dry-run``), and suggested layouts. docs/planning.md."""

from sapo_megatron.plan.layouts import Suggestion, format_suggestions, suggest_layouts
from sapo_megatron.plan.report import PLAN_SCHEMA, Plan, PlanSettings, build_plan, format_plan, plan_to_json
from sapo_megatron.plan.static import StageShard, StaticMemory, memory_estimate, stage_shards

__all__ = [
    "PLAN_SCHEMA",
    "Plan",
    "PlanSettings",
    "StageShard",
    "StaticMemory",
    "Suggestion",
    "build_plan",
    "format_plan",
    "format_suggestions",
    "memory_estimate",
    "plan_to_json",
    "stage_shards",
    "suggest_layouts",
]
