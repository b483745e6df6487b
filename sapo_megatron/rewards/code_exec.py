"""``code_exec``: run the response's Python code against test cases in the sandbox (:mod:`.sandbox`).

The code: ``<think>...</think>`` spans are dropped, then the last fenced block marked ``python`` / ``py`` /
``python3`` is taken (as verl's ``prime_code`` does: the text after the last ```` ```python ```` up to the next
fence; slime's ``rm_hub/code_verifier.py`` the same); else the last fenced block of any language; else the whole
response.

The tests come from ``metadata`` (a dict, or a JSON string of one), else from the label when it is a JSON string
(verl's Eurus-2-RL-Code parquet keeps them in ``reward_model.ground_truth``). Accepted shapes:

- ``{"inputs": [stdin, ...], "outputs": [stdout, ...]}``: each pair is one test: the program reads ``stdin`` and
  passes when its stdout equals ``stdout`` token by token (whitespace-insensitive, numbers within 1e-6, as
  the APPS checker and slime's ``code_verifier`` compare). With ``"fn_name": "f"`` the tests call ``f(*args)``
  (or ``Solution().f(*args)``) with each input a JSON list of arguments (or a string of JSON lines, one argument
  each) and compare the return value with the output (JSON; an output wrapped in a one-element list also
  matches);
- ``{"test": "assert ..."}`` (one test) or ``{"tests": ["assert ...", ...]}`` (one test each): the script runs
  with the functions and classes the solution defines in scope and passes when every statement of it ran;
  ``"imports"`` / ``"test_imports"`` (MBPP's: a list of import lines) run before it, and ``"entry_point"``
  (HumanEval's) is the function a ``check(candidate)`` test is called with.

A task whose tests cannot judge (empty, asserting nothing, ``check`` never called, inputs and outputs that do not
pair) is a task error, raised before any code runs (:mod:`.code_tasks`); so are settings out of range.

``fn_name`` and assertion tests run in a checker process of their own beside the solution's
(:func:`.sandbox.run_checked`): the checker calls into the solution and receives plain values only, and the
verdict is the checker's. Exiting early (``sys.exit``, ``os._exit``, ``atexit``), patching ``json`` or the
harness, returning an object that equals everything, or shadowing a builtin the test uses all score 0
(tests/rewards/test_sandbox.py). Tests that need an object of the test's own passed into the solution (a callback,
a class instance defined by the test) fail: only plain values and the solution's own objects cross. Stdin/stdout
tests compare the program's output with the expected one, which never enters the sandbox.

Score (``mode``): ``"all"`` (default, as verl's ``prime_code``: 1.0 when every test passes, else 0.0; stops at the
first failure) or ``"fraction"`` (passed / total, every test run). Fields: ``passed``, ``total``. A response
without code or a label/metadata without tests scores 0.0 with ``error``-free field ``reason``.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any, Literal

from sapo_megatron.rewards.code_tasks import (
    CodeTaskError,
    check_pairs,
    check_script,
    check_settings,
    expected_value,
)
from sapo_megatron.rewards.sandbox import SandboxLimits, exact_int, run_checked, run_python

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON = {"python", "py", "python3"}

_CALL_TEST = """
_fn = getattr(__solution__, {name!r}, None)
if _fn is None:
    _fn = getattr(__solution__.Solution(), {name!r})
__report__(_fn(*__import__("json").loads({args!r})))
"""
"""The checker's test for a ``fn_name`` case (:func:`.sandbox.run_checked`): the function or ``Solution``
method called in the solution's process, its plain result reported by the checker."""


def extract_code(response: str) -> str:
    """The code of a response by the rule in the module docstring."""
    text = _THINK.sub("", response)
    blocks = _FENCE.findall(text)
    python = [body for lang, body in blocks if lang.lower() in _PYTHON]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return text


def parse_tests(label: str, metadata: Any) -> dict[str, Any] | None:
    """The test description (see the module docstring), or None when there is none."""
    for candidate in (metadata, label):
        if isinstance(candidate, str):
            try:
                candidate = json.loads(candidate, parse_int=exact_int)
            except ValueError:
                continue
        if isinstance(candidate, dict) and (
            "inputs" in candidate or "test" in candidate or "tests" in candidate
        ):
            return candidate
    return None


def code_exec(
    response: str,
    label: str,
    metadata: Any = None,
    *,
    mode: Literal["all", "fraction"] = "all",
    wall_s: float = 5.0,
    cpu_s: int = 5,
    total_wall_s: float = 20.0,
    memory_mb: int = 1024,
    max_tests: int | None = None,
    require_isolation: bool = False,
) -> dict[str, Any]:
    """``{"score", "passed", "total"}`` for the response's code on the tests (module docstring). Tests still
    unrun after ``total_wall_s`` fail (keep it below ``algorithm.reward_timeout_s``: slow code is then a wrong
    answer, not a reward error)."""
    check_settings(
        {"mode": mode, "wall_s": wall_s, "cpu_s": cpu_s, "total_wall_s": total_wall_s, "memory_mb": memory_mb}
        | {"max_tests": max_tests}
    )
    tests = parse_tests(label, metadata)
    if tests is None:
        return {"score": 0.0, "passed": 0, "total": 0, "reason": "no test cases in metadata or label"}
    code = extract_code(response)
    cases = _cases(tests)[:max_tests]  # every case checked (a task error raises) before any runs
    passed, deadline = 0, time.monotonic() + total_wall_s
    for run in cases:
        left = deadline - time.monotonic()
        if left <= 0.05:
            break
        limits = SandboxLimits(wall_s=min(wall_s, left), cpu_s=cpu_s, memory_mb=memory_mb)
        if run(code, limits, require_isolation):
            passed += 1
        elif mode == "all":
            break
    total = len(cases)
    score = passed / total if mode == "fraction" else float(passed == total)
    return {"score": score if total else 0.0, "passed": passed, "total": total}


def _cases(tests: dict[str, Any]) -> list:
    if "inputs" in tests:
        pairs = check_pairs(tests)
        if tests.get("fn_name"):
            return [_call_case(tests["fn_name"], args, expected_value(out)) for args, out in pairs]
        return [_stdio_case(inp, out) for inp, out in pairs]
    scripts = [tests["test"]] if "test" in tests else tests["tests"]
    if not isinstance(scripts, list) or not scripts:
        raise CodeTaskError("code_exec task error: 'tests' must be a non-empty list of test scripts")
    imports = tests.get("imports") or tests.get("test_imports") or []
    if not isinstance(imports, list) or not all(isinstance(line, str) for line in imports):
        raise CodeTaskError("code_exec task error: 'imports' / 'test_imports' must be a list of import lines")
    prelude = "".join(line + "\n" for line in imports)
    return [_assert_case(prelude + check_script(script, tests.get("entry_point"))) for script in scripts]


def _stdio_case(stdin: Any, expected: Any):
    def run(code: str, limits: SandboxLimits, require: bool) -> bool:
        result = run_python(
            {"solution.py": code}, "solution.py", _text(stdin), limits, require_isolation=require
        )
        return result.returncode == 0 and same_output(result.stdout, _text(expected))

    return run


def _call_case(name: str, args: Any, want: Any):
    def run(code: str, limits: SandboxLimits, require: bool) -> bool:
        test = _CALL_TEST.format(name=name, args=json.dumps(_arguments(args)))
        verdict = run_checked({"solution.py": code}, test, limits, require_isolation=require).verdict
        if not verdict or verdict.get("ok") is not True or "value" not in verdict:
            return False
        got = verdict["value"]
        return got == want or (isinstance(want, list) and len(want) == 1 and got == want[0])

    return run


def _assert_case(script: str):
    def run(code: str, limits: SandboxLimits, require: bool) -> bool:
        verdict = run_checked({"solution.py": code}, script, limits, require_isolation=require).verdict
        return verdict is not None and bool(verdict) and verdict.get("ok") is True

    return run


def same_output(actual: str, expected: str) -> bool:
    """Token by token (whitespace-insensitive); numeric tokens may differ by 1e-6 (as slime's
    ``rm_hub/code_verifier.py`` compares)."""
    got, want = actual.split(), expected.split()
    if got == want:
        return True
    if len(got) != len(want):
        return False
    try:
        return all(math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6) for a, b in zip(got, want))
    except ValueError:
        return False


def _arguments(args: Any) -> list:
    if isinstance(args, list):
        return args
    if isinstance(args, str):
        try:
            return [json.loads(line) for line in args.splitlines() if line.strip()]
        except ValueError:
            return [args]
    return [args]


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)
