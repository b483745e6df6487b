"""The code sandbox against the code_exec rows of the hostile cases (/work/shared/hostile-cases/cases.tsv, issue
30): each row is a case here, named as there, and each must now be contained (CLEAR: the attempt fails inside
the sandbox, or has no effect outside it). The five rows that crossed the boundary on 19f5fae (EXPOSURE) and the
two reward hacks (SILENT) are marked. These need the namespaces (root with CAP_SYS_ADMIN, as in CI); the fallback
without them is tested in test_code_exec.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sapo_megatron.rewards.code_exec import code_exec
from sapo_megatron.rewards.sandbox import (
    SandboxLimits,
    readonly_set,
    run_checked,
    run_python,
    sandbox_python,
)

REPO = Path(__file__).resolve().parents[2]
FAST = SandboxLimits(wall_s=15.0, cpu_s=1, memory_mb=512, max_file_mb=16, max_procs=16, tmpfs_mb=32)
ROOMY = {"wall_s": 30.0, "total_wall_s": 60.0}

ATTEMPT = """
import ctypes, errno, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
def call(result):
    if result != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
def attempt(what):
    try:
        what()
    except (OSError, ValueError) as exc:
        print("blocked", errno.errorcode.get(getattr(exc, "errno", None) or 0, type(exc).__name__))
    else:
        print("reached")
"""


def attempt(code: str, limits: SandboxLimits = FAST) -> str:
    result = run_python({"s.py": ATTEMPT + code}, "s.py", limits=limits)
    assert result.stderr == "" and result.returncode == 0, result
    return result.stdout


# case of cases.tsv -> the attempt (one line, ``attempt(...)``), each printing "blocked ERRNO" or "reached"
BLOCKED = {
    "read /etc/shadow": "attempt(lambda: open('/etc/shadow').read())",
    "read the checkout's README [was EXPOSURE]": f"attempt(lambda: open({str(REPO / 'README.md')!r}).read())",
    "list the folder above the checkout [was EXPOSURE]": f"attempt(lambda: os.listdir({str(REPO.parent)!r}))",
    "list the home folder": f"attempt(lambda: os.listdir({str(Path.home())!r}))",
    "see the test's folder": f"attempt(lambda: os.listdir({str(Path(__file__).parent)!r}))",
    "write /run/lock (persists on host) [was EXPOSURE]": "attempt(lambda: open('/run/lock/sapo_case', 'w'))",
    "TCP external": "attempt(lambda: socket.create_connection(('192.0.2.1', 80), timeout=2))",
    "/proc/1/environ": "attempt(lambda: open('/proc/1/environ', 'rb').read())",
    "ptrace parent": "attempt(lambda: call(libc.ptrace(16, os.getppid(), 0, 0)))",  # PTRACE_ATTACH
    "raise RLIMIT_AS": "import resource\nattempt(lambda: resource.setrlimit(resource.RLIMIT_AS, (-1, -1)))",
    "raise RLIMIT_NPROC": "import resource\nattempt(lambda: resource.setrlimit(resource.RLIMIT_NPROC, (-1, -1)))",
    "setuid(0)": "attempt(lambda: os.setuid(0))",
    "unshare(CLONE_NEWUSER)": "attempt(lambda: call(libc.unshare(0x10000000)))",
    "mount tmpfs": "attempt(lambda: call(libc.mount(b'tmpfs', b'/tmp/work', b'tmpfs', 0, b'size=1g')))",
    "setuid /usr/bin/mount --bind": "import subprocess\n"
    "attempt(lambda: subprocess.run(['/usr/bin/mount', '--bind', '/tmp', '/tmp/work'], check=True))",
    "write cgroup": "attempt(lambda: open('/sys/fs/cgroup/cgroup.procs', 'w').write(str(os.getpid())))",
    "sysrq": "attempt(lambda: open('/proc/sysrq-trigger', 'w').write('h'))",
}


@pytest.mark.parametrize("case", list(BLOCKED))
def test_the_attempt_fails_inside_the_sandbox(isolated, case):
    assert attempt(BLOCKED[case]).startswith("blocked"), case


def test_the_code_sees_only_the_read_only_set(isolated):
    """The private root's whole tree: the interpreter and its libraries; no checkout, home, /run content, /etc."""
    listing = "import json\nprint(json.dumps([os.listdir(p) for p in ('/', '/run', '/etc', '/dev')]))"
    top, run, etc, dev = json.loads(attempt(listing))
    exposed = {Path(path).parts[1] for path in readonly_set(sandbox_python())}  # e.g. usr, lib, lib64, etc
    assert set(top) == exposed | {"dev", "proc", "tmp", "var", "run", "etc"}
    assert run == [] and etc == ["ld.so.cache"]
    assert set(dev) == {"null", "zero", "full", "random", "urandom", "fd", "stdin", "stdout", "stderr", "shm"}


def test_writes_stay_private_and_are_capped(isolated):
    """ "write /tmp", "write /var/tmp, /dev/shm": into the private tmpfs, gone with the run. "fill disk via work
    dir (600 MB)" [was EXPOSURE], "fill /tmp tmpfs": one file stops at 16 MiB (RLIMIT_FSIZE, EFBIG), many files
    at the tmpfs's size (ENOSPC), in the work dir as anywhere else."""
    name = f"sapo_case_{uuid.uuid4().hex}"
    code = f"""
for folder in ('/tmp', '/var/tmp', '/dev/shm', '/tmp/work', '/run/lock'):
    attempt(lambda: open(folder + '/{name}', 'w').write('x'))
def fill(paths):
    written, made = 0, []
    try:
        for path in paths:
            made.append(path)
            with open(path, 'wb') as stream:
                for _ in range(600 // len(paths)):
                    stream.write(b'x' * (1 << 20)); stream.flush(); written += 1
    except OSError as exc:
        print(errno.errorcode[exc.errno], written)
    for path in made:
        os.remove(path)
fill(['/tmp/work/one'])
fill([f'/tmp/work/f{{i}}' for i in range(75)])
fill([f'/tmp/f{{i}}' for i in range(75)])
"""
    out = attempt(code).strip().split("\n")
    assert out[:5] == ["reached"] * 4 + [
        "blocked ENOENT"
    ]  # "write /run/lock (persists on host)" [was EXPOSURE]
    (one, one_mb), (work, work_mb), (tmp, tmp_mb) = (line.split() for line in out[5:])
    assert one == "EFBIG" and int(one_mb) == FAST.max_file_mb
    assert work == tmp == "ENOSPC" and int(work_mb) < FAST.tmpfs_mb and int(tmp_mb) < FAST.tmpfs_mb
    for folder in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        assert not os.path.exists(f"{folder}/{name}")  # nothing on the host


def test_write_a_folder_outside_the_sandbox(isolated, tmp_path):
    target = tmp_path / "outside.txt"
    assert attempt(f"attempt(lambda: open({str(target)!r}, 'w').write('x'))").startswith("blocked ENOENT")
    assert not target.exists()


def test_tcp_to_a_listener_on_127_0_0_1(isolated):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        out = attempt(f"attempt(lambda: socket.create_connection(('127.0.0.1', {port}), timeout=2))")
        assert out.startswith("blocked")
        with pytest.raises(TimeoutError):
            listener.accept()


def test_host_unix_sockets_are_out_of_reach(isolated, tmp_path):
    """ "connect /run/munge/munge.socket.2" [was EXPOSURE]: a host daemon's filesystem socket (a listener of this
    test's, and munge's where it runs) cannot be reached: the path does not exist in the private root."""
    path = tmp_path / "daemon.sock"
    with socket.socket(socket.AF_UNIX) as daemon:
        daemon.bind(str(path))
        daemon.listen(1)
        connect = "lambda p: attempt(lambda: socket.socket(socket.AF_UNIX).connect(p))"
        out = attempt(f"for p in ({str(path)!r}, '/run/munge/munge.socket.2'):\n    ({connect})(p)")
    assert out.split("\n")[:2] == ["blocked ENOENT", "blocked ENOENT"]


@pytest.fixture
def host_server():
    """A host process holding a secret on its command line, as ``serve --api-key`` does."""
    secret = f"sk-{uuid.uuid4().hex}"
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--api-key", secret])
    yield process, secret
    process.kill()
    process.wait()


def test_own_proc_hides_host_processes(isolated, host_server):
    """ "host /proc: read serve --api-key from cmdline" [was EXPOSURE]: the sandbox's /proc lists its own PID
    namespace only: the launcher (1) and the code (2)."""
    process, secret = host_server
    code = """
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
cmdlines = b''.join(open(f'/proc/{p}/cmdline', 'rb').read() for p in pids)
print(json.dumps({"pids": pids, "cmdlines": cmdlines.decode(errors='replace')}))
"""
    found = json.loads(attempt("import json\n" + code))
    assert found["pids"] == [1, 2] and secret not in found["cmdlines"]
    assert process.poll() is None  # the server was running all along, with its secret on its command line


def test_the_trainers_environment_does_not_reach_the_code(isolated, monkeypatch):
    monkeypatch.setenv("SAPO_TEST_TOKEN", "secret-token")
    code = "print(*sorted(os.environ))\nattempt(lambda: open('/proc/1/environ', 'rb').read())"
    names, proc1 = attempt(code).strip().split("\n")
    assert names == "HOME LANG PATH" and proc1.startswith("blocked")


def test_kill_parent_and_kill_minus_one(isolated, host_server):
    process, _ = host_server
    code = "import signal\nattempt(lambda: os.kill(os.getppid(), signal.SIGKILL))\n"
    code += "attempt(lambda: os.kill(-1, signal.SIGKILL))\nprint('alive')"
    out = run_python({"s.py": ATTEMPT + code}, "s.py", limits=FAST)
    # the parent is the namespace's root-owned PID 1 (EPERM); kill(-1) reaches every process the code may
    # signal except itself: in its namespace there is none (ESRCH); a host process lives on
    assert out.stdout == "blocked EPERM\nblocked ESRCH\nalive\n"
    assert process.poll() is None


def test_fork_bomb_cpu_spin_memory_and_output_are_bounded(isolated):
    bomb = (
        "import time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
    )
    bomb += "            os._exit(0)\n        n += 1\nexcept OSError:\n    print('stopped after', n)\n"
    result = run_python({"s.py": bomb.replace("import time", "import os, time")}, "s.py", limits=FAST)
    assert result.stdout.startswith("stopped after") and int(result.stdout.split()[-1]) < FAST.max_procs
    spin = run_python({"s.py": "while True:\n    pass"}, "s.py", limits=FAST)
    # the 1 s CPU limit (SIGXCPU, then SIGKILL at the hard limit), not the 15 s wall limit
    assert spin.returncode in (128 + signal.SIGKILL, 128 + signal.SIGXCPU) and not spin.timed_out
    hog = run_python({"s.py": "x = bytearray(4 << 30)"}, "s.py", limits=FAST)  # "4 GiB allocation"
    assert hog.returncode != 0 and "MemoryError" in hog.stderr
    flood = run_python({"s.py": "while True:\n    print('x' * 1000)"}, "s.py", limits=FAST)
    assert flood.returncode != 0 and len(flood.stdout) <= FAST.max_output_bytes
    assert "File too large" in flood.stderr


def _processes_with(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


def test_a_double_forked_daemon_dies_with_the_run(isolated):
    marker = f"sapo_daemon_{uuid.uuid4().hex}"
    code = f"""
import os, subprocess, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', '{marker}'])
    os._exit(0)
print('started')
"""
    assert run_python({"s.py": code}, "s.py", limits=FAST).stdout == "started\n"
    time.sleep(0.2)
    assert _processes_with(marker) == []


# -------------------------------------------------------------------------------- the verdict (reward hacks)

ADD_TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
WRONG = "def add(a, b):\n    return 0\n"
HACKS = {
    "sys.exit(0) [was SILENT]": WRONG + "import sys\nsys.exit(0)",
    "os._exit(0) [was SILENT]": WRONG + "import os\nos._exit(0)",
    "atexit os._exit(0) [was SILENT]": WRONG + "import atexit, os\natexit.register(os._exit, 0)",
    "exit inside the call": "def add(a, b):\n    import os\n    os._exit(0)",
    "always-equal result": "class Eq:\n    def __eq__(self, other):\n        return True\n"
    "def add(a, b):\n    return Eq()",
    "int subclass equal to all": "class Eq(int):\n    def __eq__(self, other):\n        return True\n"
    "def add(a, b):\n    return Eq(0)",
    "shadow a builtin the test uses": WRONG + "def all(xs):\n    return True",
    "patch AssertionError and builtins": WRONG + "import builtins\nbuiltins.AssertionError = SystemExit",
    "kill everything it can": WRONG + "import os, signal\nfor p in os.listdir('/proc'):\n"
    "    if p.isdigit() and int(p) != os.getpid():\n        try:\n            os.kill(int(p), signal.SIGKILL)\n"
    "        except OSError:\n            pass",
    "write a verdict on guessed descriptors": WRONG + "import os\nfor fd in range(3, 64):\n    try:\n"
    "        os.write(fd, b'{\"ok\": true}')\n    except OSError:\n        pass\nprint('{\"ok\": true}')",
    "StopIteration ends map() early": "def add(a, b):\n    raise StopIteration",
    "read the tests to echo them": "import os\ndef add(a, b):\n    return a + b if os.path.exists('x') else 0\n"
    "for p in os.listdir('/proc'):\n    for fd in ('0', '3', '4', '5'):\n        try:\n"
    "            print(open(f'/proc/{p}/fd/{fd}').read())\n        except OSError:\n            pass",
}


@pytest.mark.parametrize("case", list(HACKS))
def test_assertion_tests_cannot_be_forged(isolated, case):
    """ "code_exec: sys.exit(0)/os._exit(0)/atexit vs assert tests" and more: a wrong ``add`` scores 0 whatever
    else the response does; the verdict comes from the checker process."""
    tests = dict(
        ADD_TESTS, tests=[*ADD_TESTS["tests"], "assert all(map(lambda a: add(a, a) == 2 * a, [1, 2]))"]
    )
    out = code_exec(f"```python\n{HACKS[case]}\n```", "", tests, mode="fraction", **ROOMY)
    assert out == {"score": 0.0, "passed": 0, "total": 3}


def test_fn_name_tests_cannot_be_forged_by_patching_json(isolated):
    """ "code_exec: monkeypatch json.dumps vs fn_name tests" [was SILENT]: a wrong function whose module patches
    the serialisers (the old harness printed ``json.dumps(f(*args))`` in the solution's own process)."""
    calls = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]}
    patch = "import json\njson.dumps = lambda *a, **k: '3'\n"
    deeper = patch + "json.JSONEncoder.encode = lambda *a: '3'\n"
    for hack in (patch, deeper):
        out = code_exec(
            f"```python\n{hack}def add(a, b):\n    return 0\n```", "", calls, mode="fraction", **ROOMY
        )
        assert out == {"score": 0.0, "passed": 0, "total": 2}
    right = code_exec(f"```python\n{patch}def add(a, b):\n    return a + b\n```", "", calls, **ROOMY)
    assert right["score"] == 1.0  # patching json.dumps itself is harmless: only the values count


def test_honest_solutions_still_pass_under_the_checker(isolated):
    """What the checker must keep: exit() at a script's end, in-place changes, objects used through their
    attributes, a generator, exceptions a test expects, names the solution imported."""
    code = """
import math
from collections import namedtuple
Point = namedtuple('Point', 'x y')
class Node:
    def __init__(self, val, next=None):
        self.val, self.next = val, next
def reverse(head):
    prev = None
    while head:
        head.next, prev, head = prev, head, head.next
    return prev
def sort_in_place(xs):
    xs.sort()
def squares(n):
    yield from (i * i for i in range(n))
def root(x):
    if x < 0:
        raise ValueError('negative')
    return math.sqrt(x)
def point():
    return Point(1, 2)
exit()
"""
    tests = """
head = reverse(Node(1, Node(2, Node(3))))
assert [head.val, head.next.val, head.next.next.val] == [3, 2, 1] and head.next.next.next is None
xs = [3, 1, 2]
sort_in_place(xs)
assert xs == [1, 2, 3]
assert list(squares(4)) == [0, 1, 4, 9] and sum(squares(3)) == 5
try:
    root(-1)
    raise RuntimeError('no error')
except ValueError as exc:
    assert str(exc) == 'negative'
assert math.isclose(root(2), 2 ** 0.5) and point() == (1, 2)
import solution
assert solution.root(4) == 2.0
"""
    result = run_checked({"solution.py": code}, tests, FAST)
    assert result.verdict == {"ok": True}, result


def test_the_read_only_set_without_ldd(isolated, monkeypatch):
    """Where ``ldd`` is missing, the interpreter's ELF loader and the libraries it has mapped still make the set:
    the interpreter starts and its common extension modules load."""
    from sapo_megatron.rewards import sandbox

    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    readonly_set.cache_clear()
    try:
        found = readonly_set(sandbox_python())
        assert any(os.path.basename(path).startswith("ld-") for path in found)
        out = run_python({"s.py": "import ctypes, json, math, socket\nprint('ok')"}, "s.py", limits=FAST)
        assert out.stdout == "ok\n", out
    finally:
        readonly_set.cache_clear()
