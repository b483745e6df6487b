"""Work that only the main rank does, with every rank told the outcome: :func:`on_main_rank` and
:func:`broadcast_object` (identity on a single process)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from sapo_megatron.errors import UserError

T = TypeVar("T")


class HasMainRank(Protocol):
    """What :func:`on_main_rank` reads of a rank's description (``megatron.parallel.RankInfo``)."""

    @property
    def is_main(self) -> bool: ...


class MainRankFailed(UserError):
    """Raised on the other ranks when work that only the main rank does (rollout, evaluation) failed there."""


def on_main_rank(info: HasMainRank, work: Callable[[], T]) -> T:
    """Run ``work`` on the main rank only and hand its result to every rank. When it raises there, the main rank
    re-raises it and every other rank raises :class:`MainRankFailed` (same exit code), so no rank is left waiting
    in the next collective until the process-group timeout."""
    outcome: tuple[bool, Any, int] | None = None
    error: BaseException | None = None
    if info.is_main:
        try:
            outcome = (True, work(), 0)
        except Exception as exc:
            error = exc
            outcome = (False, f"{type(exc).__name__}: {exc}", getattr(exc, "exit_code", 1))
    ok, value, exit_code = broadcast_object(outcome)
    if ok:
        return value
    if error is not None:
        raise error
    failure = MainRankFailed(f"rank 0 failed: {value}")
    failure.exit_code = exit_code
    raise failure


def broadcast_object(obj, *, src: int = 0):
    """Send a picklable object from ``src`` to every rank (identity on a single process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
