"""``sapo-megatron plan`` (and the plan of ``train --dry-run``): the planner's settings from the command line,
the plan of a config's layout as text or JSON, and ``--suggest``'s layouts that fit. The options are declared in
:mod:`sapo_megatron.cli` (which must stay light); this module runs once a config is loaded."""

from __future__ import annotations

import argparse
import json
from typing import Any

from sapo_megatron.config import ConfigError, RunConfig, validate_layout
from sapo_megatron.plan import (
    PLAN_SCHEMA,
    PlanSettings,
    Suggestion,
    build_plan,
    format_plan,
    format_suggestions,
    plan_to_json,
    suggest_layouts,
)


def plan_settings(cfg: RunConfig, args: argparse.Namespace, world: int) -> PlanSettings:
    """The planner's settings from the command line (``plan`` and ``train --dry-run`` share the options)."""
    fraction = args.rollout_mem_fraction
    if fraction is not None and not cfg.rollout.shares_devices:
        raise ConfigError(
            "--rollout-mem-fraction is the share a colocated rollout engine keeps, and rollout.colocation is none",
            hint="drop the option, or set rollout.colocation: split (--set rollout.colocation=split)",
        )
    if fraction is not None and not 0 <= fraction < 1:
        raise ConfigError(f"--rollout-mem-fraction={fraction}: expected a fraction in [0, 1)")
    for name, value in (("--gpu-memory-gb", args.gpu_memory_gb), ("--prompt-tokens", args.prompt_tokens)):
        if value is not None and value <= 0:
            raise ConfigError(f"{name}={value}: expected a positive number")
    patches = getattr(args, "image_patches", 0)
    if patches < 0:
        raise ConfigError(f"--image-patches={patches}: expected a count >= 0")
    if patches and not cfg.model.arch.is_vl:
        raise ConfigError(f"--image-patches: the model ({cfg.model.arch.model_type}) has no vision tower")
    return PlanSettings(
        world_size=world,
        gpu_memory_gib=args.gpu_memory_gb,
        prompt_tokens=args.prompt_tokens,
        rollout_mem_fraction=fraction,
        spec=args.spec,
        image_patches=patches,
    )


def run_plan(cfg: RunConfig, args: argparse.Namespace) -> int:
    """Print the plan (text or JSON); exit 0 when every rank fits, 1 when not. With ``--suggest``, a layout that
    is invalid on this world size is reported and the suggestions still printed."""
    world = args.world_size or cfg.launch.world_size
    settings = plan_settings(cfg, args, world)
    invalid: str | None = None
    try:
        validate_layout(cfg, world)
    except ConfigError as err:
        if not args.suggest:
            raise
        invalid = str(err)
    suggestions = suggest_layouts(cfg, settings, args.suggest) if args.suggest else None
    fits = _print_plan(cfg, settings, suggestions, invalid, as_json=args.json)
    return 0 if fits else 1


def _print_plan(
    cfg: RunConfig,
    settings: PlanSettings,
    suggestions: list[Suggestion] | None,
    invalid: str | None,
    *,
    as_json: bool,
) -> bool:
    plan = None if invalid else build_plan(cfg, settings)
    if as_json:
        out: dict[str, Any] = (
            plan_to_json(plan) if plan else {"schema": PLAN_SCHEMA, "invalid_layout": invalid, "fits": False}
        )
        if suggestions is not None:
            out["suggestions"] = [s.to_json() for s in suggestions]
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan) if plan else f"the config's layout on {settings.world_size} GPUs: {invalid}")
        if suggestions is not None:
            print("\n" + format_suggestions(suggestions, settings))
    return plan is not None and plan.fits
