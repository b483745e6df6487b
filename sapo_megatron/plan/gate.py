"""The planner's verdict as a gate: ``train`` refuses a layout the planner says cannot fit (unless ``--force``).

Only for runs that name their GPU (``launch.gpu_type``): the verdict compares against that GPU's memory, and a CPU
run (no GPU type) has none to exceed. The plan is an estimate, hence the way out.
"""

from __future__ import annotations

from sapo_megatron.config import RunConfig
from sapo_megatron.errors import UserError
from sapo_megatron.plan.report import Plan, PlanSettings, build_plan


class LayoutDoesNotFit(UserError):
    """The planner estimates that a rank's memory exceeds its GPU."""


def unfit_summary(plan: Plan) -> str:
    """One line: which pipeline stage needs how much of how much (the first that does not fit)."""
    stage = next(s for s in plan.stages if not s.fits)
    gib = 1 << 30
    return (
        f"pipeline stage {stage.shard.pp_rank} needs about {stage.total / gib:.1f} GiB of the "
        f"{plan.budget / gib:.1f} GiB left per GPU"
    )


def check_layout_fits(cfg: RunConfig, *, force: bool = False) -> None:
    """Raise :class:`LayoutDoesNotFit` when ``cfg`` names a GPU type and the plan does not fit, unless ``force``."""
    if cfg.launch.gpu_type is None:
        return
    plan = build_plan(cfg, PlanSettings(world_size=cfg.launch.world_size))
    if plan.fits:
        return
    message = f"{cfg.name}: the layout does not fit on {cfg.launch.gpu_type}: {unfit_summary(plan)}"
    if force:
        print(f"warning: {message}; training anyway (--force)", flush=True)
        return
    raise LayoutDoesNotFit(
        message,
        hint="`sapo-megatron plan CONFIG --suggest` lists layouts that fit; raise tp/pp/ep, recompute, or shrink "
        "the micro-batch; --force trains anyway (the plan is an estimate)",
    )
