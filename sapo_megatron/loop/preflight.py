"""The start-up checks of a run, listed once: ``train`` runs them before it starts any rank, ``train --dry-run``
after it prints the plan, and every rank's session before its process groups form. A config that fails one is
refused with the same line by all three, before anything expensive starts.

:func:`preflight` is the list of what a config alone decides (its input files, its reward, its trackers);
:func:`check_run_data` reads and checks every prompt row; :func:`check_training_precision` is ``train``'s check of
the machine it trains on (the dry run and ``plan`` work without Transformer Engine)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sapo_megatron.errors import ConfigError
from sapo_megatron.loop.inputs import check_input_files
from sapo_megatron.rewards.runner import check_reward_available
from sapo_megatron.runtime.wandb_tracking import check_trackers

if TYPE_CHECKING:
    from sapo_megatron.config import RunConfig
    from sapo_megatron.data.loading import RunData


def check_reward(cfg: RunConfig) -> None:
    """``algorithm.reward`` imports (or is registered, or is a server URL) and takes ``reward_kwargs``."""
    check_reward_available(cfg.algorithm.reward, kwargs=cfg.algorithm.reward_kwargs)


STARTUP_CHECKS: tuple[Callable[[RunConfig], None], ...] = (
    check_input_files,  # every path the config names exists (data, eval datasets, tokenizer, model, teachers)
    check_reward,  # the reward can be called with its settings
    check_trackers,  # tracking.wandb has its package
)
"""The checks :func:`preflight` runs, in order."""


def preflight(cfg: RunConfig) -> None:
    """Run :data:`STARTUP_CHECKS` on ``cfg``; the first that fails raises its one-line error."""
    for check in STARTUP_CHECKS:
        check(cfg)


def check_run_data(cfg: RunConfig, *, verbose: bool = False) -> RunData:
    """Every row of the prompt data read, its schema and length checked (with the tools the prompts show), and
    its labels checked against the reward; ``verbose`` (the dry run) prints rows per source and times."""
    from sapo_megatron.data.loading import build_run_data
    from sapo_megatron.rewards.registry import check_labels
    from sapo_megatron.rollout.episodes import tool_schemas

    data = build_run_data(cfg, verbose=verbose, tools=tool_schemas(cfg.rollout.multi_turn))
    check_labels(cfg.algorithm.reward, data.train_rows, cfg.data.train)
    return data


def check_training_precision(cfg: RunConfig) -> None:
    """FP8 training needs Transformer Engine and a GPU that runs the recipe: refuse before any rank starts."""
    from sapo_megatron.model.precision import fp8_runtime_problem

    if cfg.precision.dtype == "fp8":
        problem = fp8_runtime_problem(cfg.precision.fp8_recipe)
        if problem:
            raise ConfigError(
                problem, hint="`sapo-megatron plan CONFIG` and `train --dry-run` work without it"
            )
