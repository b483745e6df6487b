"""Verdicts that cannot be forged or vacuous (issue 39, area "verdicts"): the tests' scope holds the solution's
functions and classes, never its other globals (a test's ``math`` is the real one); tests that cannot judge are
task errors, named, before any code runs (CLEAR: the sample's reward error says what is wrong); settings out of
range are refused when the reward is checked before training (CLEAR); long integers and non-JSON expected outputs
are judged (OK). On 3855bb6 a wrong answer scored 1.0 through the solution's ``math``, vacuous tests scored every
response 1.0, and the settings silently dropped a test or failed every response."""

from __future__ import annotations

import sys

import pytest

from sapo_megatron.errors import UserError
from sapo_megatron.rewards.code_exec import code_exec
from sapo_megatron.rewards.code_tasks import CodeTaskError
from sapo_megatron.rewards.runner import build_reward_runner, check_reward_available
from sapo_megatron.rewards.types import RewardInput
from tests.security.hostile import case, expect

AREA = "verdicts"
ROOMY = {"wall_s": 20.0, "total_wall_s": 60.0}


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def score(code: str, tests: dict) -> dict:
    return code_exec(fenced(code), "", tests, **ROOMY)


FAKE_MATH = {
    "a class": "class math:\n    pi = 3\n    def isclose(*a, **k):\n        return True\n",
    "an instance": "class _M:\n    def isclose(self, *a, **k):\n        return True\nmath = _M()\n",
}


@pytest.mark.parametrize("cls", [case(AREA, "test uses the solution's math", "OK")])
@pytest.mark.parametrize("fake", list(FAKE_MATH))
def test_the_tests_math_is_never_the_solutions(cls, fake):
    tests = {"test": "assert math.isclose(area(2), 12.566, rel_tol=1e-3)"}
    wrong = FAKE_MATH[fake] + "def area(r):\n    return 1.0\n"
    right = "import math\ndef area(r):\n    return math.pi * r * r\n"
    assert expect(cls, lambda: score(wrong, tests))["score"] == 0.0
    assert score(right, tests)["score"] == 1.0  # an honest solution that imports math still passes
    mbpp = {"tests": ["assert math.isclose(area(2), 12.566, rel_tol=1e-3)"], "test_imports": ["import math"]}
    assert score("def area(r):\n    return 3.14159 * r * r\n", mbpp)["score"] == 1.0  # declared imports run


def test_only_what_the_solution_defines_is_in_the_tests_scope():
    code = "LIMIT = 5\nimport json as j\ndef f():\n    return 1\nclass C:\n    pass\n"
    assert score(code, {"test": "assert f() == 1 and C is not None"})["score"] == 1.0
    assert score(code, {"test": "assert LIMIT == 5"})["score"] == 0.0  # NameError: a constant is not in scope
    assert score(code, {"test": "import solution\nassert solution.LIMIT == 5"})["score"] == 1.0


def task_error(tests: dict, *words: str) -> str:
    """The runner's view: the sample's error names the task error; no score but 0, counted."""
    row = RewardInput(response=fenced("def f(x):\n    return x + 1\n"), label="", metadata=tests)
    with build_reward_runner("code_exec", workers=0, timeout_s=60.0, kwargs=ROOMY) as runner:
        [out] = runner.score([row])
    assert out.score == 0.0 and out.error is not None
    for word in words:
        assert word in out.error, out.error
    with pytest.raises(CodeTaskError):
        code_exec(fenced("def f(x):\n    return x\n"), "", tests)  # raised before any code runs
    return out.error


VACUOUS = {
    "check() defined and never called": (
        {"test": "def check(candidate):\n    assert candidate(1) == 2\n"},
        "defines check() but never calls it",
    ),
    "empty test": ({"test": ""}, "the test is empty"),
    "comment-only test": ({"test": "# assert f(1) == 2\n"}, "the test is empty"),
    "test that asserts nothing": ({"test": "f(1)\nf(2)"}, "asserts nothing"),
    "stdio 3 inputs 1 output": ({"inputs": ["1", "2", "3"], "outputs": ["2"]}, "3 inputs but 1 outputs"),
}


@pytest.mark.parametrize(("cls", "name"), [case(AREA, name, "CLEAR", name) for name in VACUOUS])
def test_a_test_that_cannot_judge_is_a_named_task_error(cls, name):
    tests, words = VACUOUS[name]
    assert cls == "CLEAR"
    task_error(tests, "code_exec task error", words)


def test_humaneval_check_is_called_with_the_entry_point():
    tests = {"test": "def check(candidate):\n    assert candidate(1) == 2\n", "entry_point": "f"}
    assert score("def f(x):\n    return x + 1\n", tests)["score"] == 1.0
    assert score("def f(x):\n    return x\n", tests)["score"] == 0.0


@pytest.mark.parametrize("cls", [case(AREA, "right answer over 4300 digits", "OK")])
def test_a_long_integer_answer_is_judged_exactly(cls):
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        digits = str(7**6000)  # 5,071 digits
    finally:
        sys.set_int_max_str_digits(limit)
    tests = {"fn_name": "f", "inputs": [[]], "outputs": [digits]}
    right = expect(cls, lambda: score("def f():\n    return 7 ** 6000\n", tests))
    assert right["score"] == 1.0
    assert score("def f():\n    return 7 ** 6000 + 1\n", tests)["score"] == 0.0


@pytest.mark.parametrize("cls", [case(AREA, "expected output a bare string", "OK")])
def test_a_non_json_expected_output_is_that_string(cls):
    tests = {"fn_name": "f", "inputs": [[]], "outputs": ["hello world"]}
    assert expect(cls, lambda: score("def f():\n    return 'hello world'\n", tests))["score"] == 1.0
    assert score("def f():\n    return 'hello'\n", tests)["score"] == 0.0


@pytest.mark.parametrize(
    ("cls", "kwargs", "word"),
    [
        case(AREA, "reward_kwargs max_tests -1", "CLEAR", {"max_tests": -1}, "max_tests=-1"),
        case(AREA, "reward_kwargs memory_mb 16", "CLEAR", {"memory_mb": 16}, "memory_mb=16"),
        case(AREA, "reward_kwargs wall_s 0", "CLEAR", {"wall_s": 0}, "wall_s=0"),
    ],
)
def test_settings_out_of_range_are_refused_before_training(cls, kwargs, word):
    error = expect(cls, lambda: check_reward_available("code_exec", kwargs=kwargs), word, "out of range")
    assert isinstance(error, UserError)
