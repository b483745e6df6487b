"""What a ``code_exec`` task must hold before any response runs against it, and the ranges of its settings.

A task whose tests cannot judge would score every response alike – usually 1.0, without a word. These are
refused as **task errors** (:class:`CodeTaskError`: the sample's reward error, counted in ``reward/errors`` and
named in the log and the error budget's message, never a score):

- an empty or comment-only test, a test that does not parse, or one that asserts nothing (no ``assert``,
  ``raise`` or ``self.assert...``: every response would pass);
- a HumanEval-style test that defines ``check(candidate)`` and never calls it: with the task's ``entry_point``
  the call ``check(ENTRY_POINT)`` is added (HumanEval's harness does the same), else refused;
- stdio / ``fn_name`` tests whose ``inputs`` and ``outputs`` differ in number (a zip would silently drop the
  rest), or none at all.

Expected ``fn_name`` outputs are read before the code runs: JSON (integers of any length, compared exactly –
Python's 4,300-digit conversion limit does not apply), or, when an output is a string that is not JSON, that
string itself (``"hello"`` expects the return value ``"hello"``).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any

from sapo_megatron.rewards.sandbox import exact_int

SETTING_RANGES: dict[str, tuple[float, float]] = {
    "wall_s": (0.1, 600.0),
    "cpu_s": (1, 600),
    "total_wall_s": (0.1, 3600.0),
    "memory_mb": (64, 1 << 20),
    "max_tests": (1, 1_000_000),
}
"""``reward_kwargs`` of ``code_exec`` and their allowed ranges (inclusive). Below 64 MiB the interpreter cannot
start (measured: 8 MiB cannot load libm, 16 MiB starts a script but not the checker)."""


class CodeTaskError(ValueError):
    """The task's tests cannot judge a response; the message names what is wrong and what would fix it."""


def check_settings(settings: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first ``code_exec`` setting out of its range (or of the wrong type)."""
    for key, (low, high) in SETTING_RANGES.items():
        value = settings.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ValueError(
                f"code_exec {key}={value!r} is out of range: use a number from {low:g} to {high:g}"
            )
        if key in ("cpu_s", "memory_mb", "max_tests") and int(value) != value:
            raise ValueError(f"code_exec {key}={value!r} must be a whole number")
    mode = settings.get("mode", "all")
    if mode not in ("all", "fraction"):
        raise ValueError(f"code_exec mode must be 'all' or 'fraction', got {mode!r}")


def check_pairs(tests: Mapping[str, Any]) -> list[tuple[Any, Any]]:
    """The (input, output) pairs of stdio / ``fn_name`` tests; :class:`CodeTaskError` when they do not pair."""
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise CodeTaskError(
            "code_exec task error: 'inputs' and 'outputs' must both be lists "
            f"(got {type(inputs).__name__} and {type(outputs).__name__})"
        )
    if len(inputs) != len(outputs):
        raise CodeTaskError(
            f"code_exec task error: {len(inputs)} inputs but {len(outputs)} outputs; each input needs its output "
            "(fix the row's tests)"
        )
    if not inputs:
        raise CodeTaskError("code_exec task error: no test cases (empty 'inputs')")
    return list(zip(inputs, outputs))


def expected_value(output: Any) -> Any:
    """An ``fn_name`` test's expected return value: JSON text parsed (long integers exact), a string that is
    not JSON as itself, anything else as it is."""
    if not isinstance(output, str):
        return output
    try:
        return json.loads(output, parse_int=exact_int)
    except ValueError:
        return output


def check_script(script: Any, entry_point: Any = None) -> str:
    """The assertion test to run: ``script``, with ``check(ENTRY_POINT)`` added for a HumanEval-style test that
    defines ``check`` and never calls it; :class:`CodeTaskError` for a test that cannot judge (module docstring)."""
    if not isinstance(script, str):
        raise CodeTaskError(f"code_exec task error: a test must be Python text, got {type(script).__name__}")
    try:
        tree = ast.parse(script)
    except SyntaxError as exc:
        raise CodeTaskError(
            f"code_exec task error: the test does not parse ({exc.msg}, line {exc.lineno})"
        ) from None
    if not tree.body:
        raise CodeTaskError(
            "code_exec task error: the test is empty (or only comments): it would pass every response"
        )
    if not any(_asserts(node) for node in ast.walk(tree)):
        raise CodeTaskError(
            "code_exec task error: the test asserts nothing (no assert, raise or self.assert...): it would pass "
            "every response"
        )
    defines = any(isinstance(node, ast.FunctionDef) and node.name == "check" for node in tree.body)
    if defines and not _calls_check(tree):
        if not isinstance(entry_point, str) or not entry_point.isidentifier():
            raise CodeTaskError(
                "code_exec task error: the test defines check() but never calls it, so nothing is checked; give "
                "the task's 'entry_point' (HumanEval's field) or end the test with check(<function>)"
            )
        script = f"{script}\n\ncheck({entry_point})\n"
    return script


def _asserts(node: ast.AST) -> bool:
    if isinstance(node, (ast.Assert, ast.Raise)):
        return True
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr.startswith(("assert", "fail"))
    )


def _calls_check(tree: ast.Module) -> bool:
    """A call of ``check`` outside the function definitions (where it would run)."""
    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "check":
                return True
    return False
