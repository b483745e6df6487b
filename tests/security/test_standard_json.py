"""Every file the project writes is standard JSON (issue 30, Why "Silent"): a non-finite number becomes null,
never ``NaN`` / ``Infinity``, which other readers refuse."""

from __future__ import annotations

import json
import math

import pytest

from sapo_megatron import jsonio
from sapo_megatron.checkpoint import atomic
from sapo_megatron.runtime.tracking import write_json_atomic


def strict_load(text: str):
    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_become_null_at_any_depth():
    value = {"a": math.inf, "b": [1.0, -math.inf, {"c": math.nan}], "d": (2.0, "x"), "e": 3}
    assert strict_load(jsonio.dumps(value)) == {
        "a": None,
        "b": [1.0, None, {"c": None}],
        "d": [2.0, "x"],
        "e": 3,
    }


@pytest.mark.parametrize("writer", ["summary", "marker"])
def test_summary_and_checkpoint_markers_are_standard(tmp_path, writer):
    data = {"avg@1": math.inf, "loss": math.nan, "steps": 2}
    if writer == "summary":
        path = write_json_atomic(tmp_path / "summary.json", data)
    else:
        path = tmp_path / "marker.json"
        atomic.write_json_durably(path, data)
    assert strict_load(path.read_text()) == {"avg@1": None, "loss": None, "steps": 2}
