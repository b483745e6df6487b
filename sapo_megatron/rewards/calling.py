"""Calling a resolved reward on one unit of work (one sample, or one group for group rewards) and turning what it
returns into :class:`RewardOutput` – the same code inline and in the pool's workers (stdlib only)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sapo_megatron.rewards.conventions import (
    GROUP,
    TRL,
    VERL,
    ConventionError,
    call_trl,
    call_verl,
    check_return,
    detect_convention,
    label_note,
)
from sapo_megatron.rewards.limits import MAX_ABS_SCORE, leave_if_forked
from sapo_megatron.rewards.loading import call_arguments, is_import_path, load_function
from sapo_megatron.rewards.outputs import error_output, safe_output
from sapo_megatron.rewards.types import RewardInput, RewardOutput


def resolve_function(spec: str) -> Callable[..., Any]:
    """The function a registered name or an import path names."""
    if is_import_path(spec):
        return load_function(spec)
    from sapo_megatron.rewards.registry import get_reward

    return get_reward(spec)


@dataclass
class BoundReward:
    """A reward function with its call convention worked out once."""

    fn: Callable[..., Any]
    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.convention = detect_convention(self.fn)
        self.group = self.convention in (GROUP, TRL)  # TRL's rewards are batched: one call per group
        self.optional = call_arguments(self.fn)

    @classmethod
    def from_spec(cls, spec: str, kwargs: Mapping[str, Any] | None = None) -> BoundReward:
        return cls(resolve_function(spec), spec, dict(kwargs or {}))

    def run(self, inputs: list[RewardInput]) -> list[RewardOutput]:
        """Outputs for one unit: a group reward's group (one call) or a single sample."""
        if self.group:
            return self._run_group(inputs)
        return [self.run_one(item) for item in inputs]

    def run_one(self, item: RewardInput) -> RewardOutput:
        extra = {name: getattr(item, name) for name in self.optional} if self.optional else {}
        pid = os.getpid()
        try:
            if self.convention == VERL:
                value = call_verl(self.fn, item, self.kwargs)
            else:
                value = self.fn(response=item.response, label=item.label, **extra, **self.kwargs)
        except (
            Exception,
            SystemExit,
            KeyboardInterrupt,
        ) as exc:  # an exit is this sample's error (limits.py)
            leave_if_forked(pid)
            out = error_output(exc)
            if isinstance(exc, (TypeError, KeyError, AttributeError)):
                out.error = f"{out.error}{label_note(item.label)}"
            return out
        leave_if_forked(pid)
        if type(value) is float and abs(value) <= MAX_ABS_SCORE:  # the common case, kept cheap
            return RewardOutput(value)
        problem = check_return(value, self.convention)
        if problem is not None:
            return RewardOutput(0.0, {}, problem)
        return safe_output(value)

    def _run_group(self, inputs: list[RewardInput]) -> list[RewardOutput]:
        pid = os.getpid()
        try:
            if self.convention == TRL:
                values = call_trl(self.fn, list(inputs), self.kwargs)
            else:
                values = list(self.fn(list(inputs), **self.kwargs))
        except ConventionError as exc:
            leave_if_forked(pid)
            return [RewardOutput(0.0, {}, str(exc)) for _ in inputs]
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            leave_if_forked(pid)
            return [error_output(exc)] * len(inputs)
        leave_if_forked(pid)
        if len(values) != len(inputs):
            message = f"group reward returned {len(values)} scores for {len(inputs)} samples"
            return [RewardOutput(0.0, {}, message)] * len(inputs)
        if self.convention == TRL:  # TRL: None is "not applicable to this sample", not an error
            return [
                RewardOutput(0.0, {"not_applicable": True}) if v is None else safe_output(v) for v in values
            ]
        return [safe_output(value) for value in values]
