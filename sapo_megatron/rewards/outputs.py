"""What a reward function returns, read as :class:`RewardOutput`: a float, a bool or a dict with ``score``
(stdlib only: reward workers import it)."""

from __future__ import annotations

import math
import traceback
from collections.abc import Mapping
from typing import Any

from sapo_megatron.rewards.limits import bounded_fields, check_score
from sapo_megatron.rewards.types import RewardOutput

_JSON_SCALARS = (str, int, float, bool, type(None))


def safe_output(value: Any) -> RewardOutput:
    """:func:`to_output`, with a value it cannot read turned into an error output (score 0)."""
    try:
        return to_output(value)
    except Exception as exc:
        return error_output(exc)


def error_output(exc: BaseException) -> RewardOutput:
    """Score 0 with the exception's type, message and the line it was raised at."""
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    if isinstance(exc, SystemExit):
        return RewardOutput(
            0.0, {}, f"the reward called sys.exit({exc.code!r}){at}; a reward returns a score"
        )
    return RewardOutput(0.0, {}, f"{type(exc).__name__}: {exc}{at}")


def to_output(value: Any) -> RewardOutput:
    """A float, a bool or a dict with ``score`` (other keys become ``fields``); non-finite scores are errors."""
    fields: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"reward returned a dict without 'score' (keys: {sorted(value)})")
        fields = bounded_fields({str(k): _jsonable(v) for k, v in value.items() if k != "score"})
        value = value["score"]
    if isinstance(value, str | bytes):
        raise ValueError(f"reward returned the text {value[:40]!r} as its score; return a number")
    score = float(value)
    problem = check_score(score)
    if problem is not None:
        return RewardOutput(0.0, fields, problem)
    return RewardOutput(score, fields)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # the logs are standard JSON: no NaN / Infinity
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)
