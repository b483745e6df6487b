"""code_exec: code extraction as verl's ``prime_code`` does (volcengine/verl,
``verl/utils/reward_score/prime_code/__init__.py``: the text after the last ```` ```python ````), the test-case
shapes (Eurus-2-RL-Code's JSON ``ground_truth``, fn_name calls, assert scripts), and containment: each hostile
program below is stopped within its limits and leaves the machine as it was."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from sapo_megatron.rewards.code_exec import code_exec, extract_code
from sapo_megatron.rewards.sandbox import SandboxLimits, isolation, run_python

# CPU-bound cases stop at the 1 s CPU limit; the wall limit is generous because the test machine may be loaded
FAST = SandboxLimits(wall_s=15.0, cpu_s=1, memory_mb=512, max_file_mb=1, max_procs=16)
ROOMY = {"wall_s": 30.0, "total_wall_s": 120.0}  # semantics tests: no limit should ever be reached


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def fenced(code: str, lang: str = "python") -> str:
    return f"Let me think.\n```{lang}\n{code}\n```\nDone."


def test_extraction_and_test_shapes():
    assert extract_code("<think>```python\nwrong\n```</think>" + fenced("right")) == "right\n"
    assert extract_code(fenced("a") + fenced("b", "py")) == "b\n"  # the last python block
    assert extract_code(fenced("x", "python") + fenced("shell", "bash")) == "x\n"  # python blocks first
    assert extract_code(fenced("only", "")) == "only\n"
    assert extract_code("print(1)") == "print(1)"  # no fence: the whole response
    double = fenced("n = int(input())\nprint(2 * n)")
    eurus = json.dumps({"inputs": ["3\n", "5\n", "0\n"], "outputs": ["6\n", "10\n", "1\n"]})
    assert code_exec(double, eurus, **ROOMY) == {"score": 0.0, "passed": 2, "total": 3}  # all-or-nothing
    assert code_exec(double, eurus, mode="fraction", **ROOMY)["score"] == pytest.approx(2 / 3)
    assert (
        code_exec(double, "", {"inputs": ["4"], "outputs": ["8  \n\n"]}, **ROOMY)["score"] == 1.0
    )  # whitespace
    calls = {"fn_name": "add", "inputs": [[1, 2], "3\n4"], "outputs": [3, [7]]}
    assert code_exec(fenced("def add(a, b):\n    return a + b"), "", calls, **ROOMY)["score"] == 1.0
    method = fenced("class Solution:\n    def add(self, a, b):\n        return a + b")
    assert code_exec(method, "", json.dumps(calls), **ROOMY)["passed"] == 2  # metadata as a JSON string
    asserts = {"tests": ["assert add(1, 2) == 3", "assert add(1, 1) == 3"]}
    assert (
        code_exec(fenced("def add(a, b):\n    return a + b"), "", asserts, mode="fraction", **ROOMY)["score"]
        == 0.5
    )
    assert code_exec(fenced("x = 1"), "7", **ROOMY)["reason"] == "no test cases in metadata or label"


@pytest.fixture
def outside_dir():
    """A directory outside the sandbox's work dir and outside /tmp (which the sandbox replaces): beside this file,
    or in the home directory when the checkout itself lies below a directory the sandbox replaces."""
    base = Path(__file__).resolve().parent
    if any(base.is_relative_to(hidden) for hidden in ("/tmp", "/var/tmp", "/dev/shm")):
        base = Path.home()
    folder = Path(tempfile.mkdtemp(dir=base, prefix="_outside_"))
    yield folder
    shutil.rmtree(folder)


def test_hostile_code_is_contained(outside_dir):
    found = isolation()
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    start = time.monotonic()
    loop = run_python({"s.py": "while True:\n    pass"}, "s.py", limits=FAST)
    assert loop.returncode != 0 and time.monotonic() - start < FAST.wall_s + 2  # CPU limit or wall timeout

    sleeper = run_python({"s.py": "import time\ntime.sleep(60)"}, "s.py", limits=SandboxLimits(wall_s=1.0))
    assert sleeper.timed_out and sleeper.returncode == -1

    fork_bomb = "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    print('stopped after', n)\n"
    bomb = run_python({"s.py": fork_bomb}, "s.py", limits=FAST)
    assert bomb.stdout.startswith("stopped after") and int(bomb.stdout.split()[-1]) < FAST.max_procs

    hog = run_python({"s.py": "x = bytearray(4 << 30)"}, "s.py", limits=FAST)
    assert hog.returncode != 0 and "MemoryError" in hog.stderr

    flood = run_python({"s.py": "while True:\n    print('x' * 1000)"}, "s.py", limits=FAST)
    assert flood.returncode != 0 and len(flood.stdout) <= FAST.max_output_bytes
    assert "File too large" in flood.stderr

    outside = outside_dir / "outside.txt"
    write = f"open({str(outside)!r}, 'w').write('x')\nopen('/tmp/sapo_sandbox_escape', 'w').write('x')\nopen('inside.txt', 'w').write('ok')\nprint('wrote')"
    result = run_python({"s.py": write}, "s.py", limits=FAST)
    if found["uid"] != 0:
        assert "PermissionError" in result.stderr
    if found["uid"] != 0 or found["private_tmp"]:
        assert not outside.exists()
    if found["private_tmp"]:
        assert not os.path.exists("/tmp/sapo_sandbox_escape")

    with socket.socket() as listener:  # only ever 127.0.0.1
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        probe = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\nexcept OSError as e:\n    print('blocked', e.errno)\n"
        net = run_python({"s.py": probe}, "s.py", limits=FAST)
        if found["net"]:
            assert net.stdout.startswith("blocked")
            with pytest.raises(TimeoutError):
                listener.accept()
        else:
            assert net.stdout.startswith("connected")  # the documented fallback: no network namespace
    time.sleep(0.2)
    leftover = {p for p in os.listdir("/proc") if p.isdigit()} - before
    alive = [p for p in leftover if b"s.py" in _cmdline(p)]
    assert alive == []  # no sandboxed process outlived its run (the fork bomb's sleepers included)


def test_without_namespaces_the_limits_still_hold_and_a_warning_says_so(monkeypatch, caplog):
    monkeypatch.setenv("SAPO_SANDBOX_NAMESPACES", "0")
    isolation.cache_clear()
    try:
        found = isolation()
        assert (found["net"], found["pid"], found["private_tmp"]) == (False, False, False)
        assert "code sandbox without full isolation here" in caplog.text
        hog = run_python({"s.py": "x = bytearray(4 << 30)"}, "s.py", limits=FAST)
        assert "MemoryError" in hog.stderr  # the rlimits do not need namespaces
        with pytest.raises(Exception, match="cannot isolate the code here"):
            run_python({"s.py": "pass"}, "s.py", limits=FAST, require_isolation=True)
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
