"""Reward functions by name, and :func:`safe_reward`, which keeps a crashing reward from stopping training."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Protocol

from sapo_megatron.rewards.answers import exact_match, numeric_match
from sapo_megatron.rewards.math_verify_reward import math_verify_reward

logger = logging.getLogger(__name__)


class RewardFn(Protocol):
    """Scores one decoded response against its ground truth; returns a float (usually 0.0 or 1.0)."""

    def __call__(self, response: str, ground_truth: str) -> float: ...


_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make a reward function available to configs under ``name``."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"a reward named {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(_REGISTRY)}") from None


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)


register_reward("exact_match")(exact_match)
register_reward("numeric_match")(numeric_match)
register_reward("math_verify")(math_verify_reward)


class SafeReward:
    """Wraps a reward: an exception (or a non-finite value) yields 0.0 and counts in ``reward/errors``.

    The first exception is logged with its traceback; later ones only count.
    """

    def __init__(self, fn: RewardFn, name: str | None = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.errors = 0
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, response: str, ground_truth: str) -> float:
        with self._lock:
            self.calls += 1
        try:
            value = float(self.fn(response, ground_truth))
            if not math.isfinite(value):
                raise ValueError(f"reward {self.name} returned {value}")
            return value
        except Exception:
            with self._lock:
                self.errors += 1
                first = self.errors == 1
            if first:
                logger.exception("reward %s raised; scoring 0.0 (later errors are only counted)", self.name)
            return 0.0

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {"reward/errors": float(self.errors), "reward/calls": float(self.calls)}


def safe_reward(fn: RewardFn, name: str | None = None) -> SafeReward:
    return SafeReward(fn, name)
