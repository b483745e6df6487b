"""code_exec: code extraction as verl's ``prime_code`` does (volcengine/verl,
``verl/utils/reward_score/prime_code/__init__.py``: the text after the last ```` ```python ````), the test-case
shapes (Eurus-2-RL-Code's JSON ``ground_truth``, fn_name calls, assert scripts), and containment: each hostile
program below is stopped within its limits and leaves the machine as it was."""

from __future__ import annotations

import json
import os
import time

import pytest

from sapo_megatron.rewards.code_exec import code_exec, extract_code
from sapo_megatron.rewards.sandbox import SandboxLimits, isolation, run_python

# CPU-bound cases stop at the 1 s CPU limit; the wall limit is generous because the test machine may be loaded
FAST = SandboxLimits(wall_s=15.0, cpu_s=1, memory_mb=512, max_file_mb=1, max_procs=16)
ROOMY = {"wall_s": 30.0, "total_wall_s": 120.0}  # semantics tests: no limit should ever be reached


def fenced(code: str, lang: str = "python") -> str:
    return f"Let me think.\n```{lang}\n{code}\n```\nDone."


def test_extraction():
    assert extract_code("<think>```python\nwrong\n```</think>" + fenced("right")) == "right\n"
    assert extract_code(fenced("a") + fenced("b", "py")) == "b\n"  # the last python block
    assert extract_code(fenced("x", "python") + fenced("shell", "bash")) == "x\n"  # python blocks first
    assert extract_code(fenced("only", "")) == "only\n"
    assert extract_code("print(1)") == "print(1)"  # no fence: the whole response
    assert code_exec(fenced("x = 1"), "7", **ROOMY)["reason"] == "no test cases in metadata or label"


def test_stdin_stdout_tests():
    double = fenced("n = int(input())\nprint(2 * n)")
    eurus = json.dumps({"inputs": ["3\n", "5\n", "0\n"], "outputs": ["6\n", "10\n", "1\n"]})
    assert code_exec(double, eurus, **ROOMY) == {"score": 0.0, "passed": 2, "total": 3}  # all-or-nothing
    assert code_exec(double, eurus, mode="fraction", **ROOMY)["score"] == pytest.approx(2 / 3)
    assert (
        code_exec(double, "", {"inputs": ["4"], "outputs": ["8  \n\n"]}, **ROOMY)["score"] == 1.0
    )  # whitespace


def test_fn_name_and_assertion_tests():
    calls = {"fn_name": "add", "inputs": [[1, 2], "3\n4"], "outputs": [3, [7]]}
    assert code_exec(fenced("def add(a, b):\n    return a + b"), "", calls, **ROOMY)["score"] == 1.0
    method = fenced("class Solution:\n    def add(self, a, b):\n        return a + b")
    assert code_exec(method, "", json.dumps(calls), **ROOMY)["passed"] == 2  # metadata as a JSON string
    asserts = {"tests": ["assert add(1, 2) == 3", "assert add(1, 1) == 3"]}
    assert (
        code_exec(fenced("def add(a, b):\n    return a + b"), "", asserts, mode="fraction", **ROOMY)["score"]
        == 0.5
    )


def test_a_sleeper_hits_the_wall_timeout():
    start = time.monotonic()
    sleeper = run_python({"s.py": "import time\ntime.sleep(60)"}, "s.py", limits=SandboxLimits(wall_s=1.0))
    assert sleeper.timed_out and sleeper.returncode == -1 and time.monotonic() - start < 10


def test_without_namespaces_the_limits_still_hold_and_a_warning_says_so(monkeypatch, caplog):
    monkeypatch.setenv("SAPO_SANDBOX_NAMESPACES", "0")
    isolation.cache_clear()
    try:
        found = isolation()
        assert (found["net"], found["pid"], found["root"], found["private_tmp"]) == (False,) * 4
        assert "code sandbox without full isolation here" in caplog.text
        hog = run_python({"s.py": "x = bytearray(4 << 30)"}, "s.py", limits=FAST)
        assert "MemoryError" in hog.stderr  # the rlimits do not need namespaces
        with pytest.raises(Exception, match="cannot isolate the code here"):
            run_python({"s.py": "pass"}, "s.py", limits=FAST, require_isolation=True)
        # the checker still runs apart from the solution (same uid here, so only as far as that uid allows)
        tests = {"tests": ["assert add(1, 2) == 3"]}
        assert code_exec(fenced("def add(a, b):\n    return a + b"), "", tests, **ROOMY)["score"] == 1.0
        exits = fenced("def add(a, b):\n    return 0\nimport os\nos._exit(0)")
        assert code_exec(exits, "", tests, **ROOMY)["score"] == 0.0
    finally:
        isolation.cache_clear()


def test_output_comparison():
    from sapo_megatron.rewards.code_exec import same_output

    assert same_output("1 2\n3\n", "1 2 3") and same_output("0.3333333", "0.33333331")
    assert not same_output("1 2", "1 2 3") and not same_output("abc", "abd") and not same_output("0.3", "0.4")


def test_slow_code_fails_its_tests_within_the_total_budget():
    slow = fenced("import time\ntime.sleep(30)")
    tests = {"inputs": ["1", "2", "3"], "outputs": ["1", "2", "3"]}
    start = time.monotonic()
    out = code_exec(slow, "", tests, mode="fraction", wall_s=1.0, total_wall_s=1.5)
    assert out == {"score": 0.0, "passed": 0, "total": 3} and time.monotonic() - start < 4


def test_a_private_root_that_cannot_be_built_is_reported_not_fatal(monkeypatch, caplog):
    """Where the kernel gives namespaces but the private root fails (here: a read-only path that does not exist),
    the code runs on the machine's file system, the probe says root=False, and require_isolation refuses."""
    from sapo_megatron.rewards import sandbox

    if os.geteuid() != 0:
        pytest.skip("the private root is built only by root (the fallback without it is the test above)")
    monkeypatch.setattr(sandbox, "readonly_set", lambda python: ("/nonexistent-sapo/python3",))
    isolation.cache_clear()
    try:
        found = isolation()
        assert found["root"] is False and found["net"] is True and found["pid"] is True
        assert "code sandbox without full isolation here" in caplog.text
        result = run_python({"s.py": "print(6 * 7)"}, "s.py", limits=FAST)
        assert result.stdout == "42\n" and "no private root here" in result.stderr
        with pytest.raises(Exception, match="cannot isolate the code here"):
            run_python({"s.py": "pass"}, "s.py", limits=FAST, require_isolation=True)
    finally:
        isolation.cache_clear()
