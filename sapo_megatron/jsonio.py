"""Standard JSON for every file the project writes (stdlib only).

Python's ``json`` writes ``NaN``, ``Infinity`` and ``-Infinity`` by default, which no other JSON reader accepts
(``jq``, JavaScript, Go, pandas' strict mode): one non-finite number made ``summary.json`` unreadable elsewhere.
:func:`dumps` writes ``null`` in their place, as the metrics rows already do, and refuses anything else
non-standard (``allow_nan=False``).
"""

from __future__ import annotations

import json
import math
from typing import Any


def standard(value: Any) -> Any:
    """``value`` with every non-finite float (at any depth of dicts, lists and tuples) replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: standard(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [standard(item) for item in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`standard` ``(value)`` with ``allow_nan=False``."""
    return json.dumps(standard(value), allow_nan=False, **kwargs)
