"""The data a reward sees and returns, and the marker of group rewards (stdlib only: reward workers import it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sapo_megatron.errors import UserError

F = TypeVar("F", bound=Callable[..., Any])

GROUP_ATTRIBUTE = "reward_group"
"""A reward function with ``fn.reward_group = True`` (set by :func:`group_reward` or by hand) is a group reward."""


@dataclass
class RewardInput:
    """One response to score. ``group_id`` ties the responses to one prompt together (group rewards are called
    once per run of equal ``group_id``; ``None`` everywhere: the whole call is one group)."""

    response: str
    label: str
    prompt: str = ""
    source: str | None = None
    metadata: Any = None
    group_id: int | None = None
    messages: list[dict[str, str]] | None = None
    """The row's prompt as chat messages, when it is a list of messages (TRL-style rewards get these)."""
    columns: dict[str, Any] | None = None
    """The row's dataset columns other than the prompt, as read (TRL-style rewards get them as keyword lists)."""

    def as_dict(self) -> dict[str, Any]:
        """The fields of the remote reward protocol (docs/rewards.md): without ``messages`` and ``columns``."""
        out = dataclasses.asdict(self)
        del out["messages"], out["columns"]
        return out


@dataclass
class RewardOutput:
    """A score, the extra fields the reward returned (JSON-serialisable, e.g. ``answer``), and ``error`` when the
    call failed, timed out, killed its worker or returned a non-finite value (the score is then 0.0)."""

    score: float
    fields: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def group_reward(fn: F) -> F:
    """Decorator: ``fn(samples: list[RewardInput]) -> list[float | dict]`` scores a prompt's whole group at once
    (e.g. rewards that rank or compare the responses). Same as setting ``fn.reward_group = True``."""
    setattr(fn, GROUP_ATTRIBUTE, True)
    return fn


def is_group_reward(fn: Callable[..., Any]) -> bool:
    return bool(getattr(fn, GROUP_ATTRIBUTE, False))


class RewardError(UserError, RuntimeError):
    """Too many of a step's rewards raised: the reward function (or what it needs) is broken."""
