"""The sandbox's last shared namespaces and kernel objects (issue 39, area "sandbox namespaces"): SysV IPC, the
session keyring, host name / boot id / kernel command line, ``memfd_create`` memory, open files, and the uid that
concurrent sandboxes shared. Each case is contained now (OK: the attempt fails inside, or has no effect outside);
on 3855bb6 each crossed (EXPOSURE) or was unbounded (SILENT). Needs the namespaces (root with CAP_SYS_ADMIN)."""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
import uuid

import pytest

from sapo_megatron.rewards.sandbox import SandboxLimits, run_python
from tests.security.hostile import case

AREA = "sandbox namespaces"
FAST = SandboxLimits(wall_s=20.0, cpu_s=2, memory_mb=512, max_procs=16, tmpfs_mb=16)
LIBC = ctypes.CDLL(None, use_errno=True)
IPC_CREAT, IPC_RMID = 0o1000, 0
KEY_SPEC_SESSION_KEYRING, KEYCTL_SEARCH = -3, 10
SYS = {"add_key": 248, "keyctl": 250} if os.uname().machine == "x86_64" else {"add_key": 217, "keyctl": 219}
PRELUDE = f"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
SYS = {SYS!r}
def attempt(what):
    try:
        result = what()
        if isinstance(result, int) and result < 0:
            raise OSError(ctypes.get_errno(), "")
    except OSError as exc:
        print("blocked", errno.errorcode.get(exc.errno, "?"))
    else:
        print("reached", result)
"""


def run(code: str, limits: SandboxLimits = FAST) -> str:
    result = run_python({"s.py": PRELUDE + code}, "s.py", limits=limits)
    assert result.returncode == 0 and result.stderr == "", result
    return result.stdout.strip()


def shm_key() -> int:
    return 0x5A000000 | (uuid.uuid4().int & 0xFFFFFF)


@pytest.mark.parametrize("cls", [case(AREA, "read a host SysV shared-memory segment", "OK")])
def test_host_sysv_memory_is_out_of_reach(isolated, cls):
    key = shm_key()
    shmid = LIBC.shmget(key, 4096, IPC_CREAT | 0o666)
    assert shmid >= 0
    try:
        assert run(f"attempt(lambda: libc.shmget({key}, 0, 0))") == "blocked ENOENT"
    finally:
        LIBC.shmctl(shmid, IPC_RMID, None)


@pytest.mark.parametrize("cls", [case(AREA, "a SysV segment left behind after the run", "OK")])
def test_a_sysv_segment_dies_with_the_run(isolated, cls):
    key = shm_key()
    assert run(f"print(libc.shmget({key}, 1 << 20, {IPC_CREAT | 0o666}) >= 0)") == "True"
    left = LIBC.shmget(key, 0, 0)
    if left >= 0:
        LIBC.shmctl(left, IPC_RMID, None)
    assert left == -1  # the code's segment lived in the run's IPC namespace only


def add_session_key(description: str) -> int:
    return LIBC.syscall(SYS["add_key"], b"user", description.encode(), b"s3cret", 6, KEY_SPEC_SESSION_KEYRING)


def find_session_key(description: str) -> int:
    return LIBC.syscall(
        SYS["keyctl"], KEYCTL_SEARCH, KEY_SPEC_SESSION_KEYRING, b"user", description.encode(), 0
    )


@pytest.mark.parametrize("cls", [case(AREA, "read a key of the trainer's session keyring", "OK")])
def test_the_trainers_keyring_is_out_of_reach(isolated, cls):
    name = f"sapo_{uuid.uuid4().hex}"
    if add_session_key(name) < 0:
        pytest.fail(f"cannot add a key to this process's session keyring: errno {ctypes.get_errno()}")
    found = run(
        f"attempt(lambda: libc.syscall(SYS['keyctl'], {KEYCTL_SEARCH}, {KEY_SPEC_SESSION_KEYRING}, b'user', "
        f"{name.encode()!r}, 0))"
    )
    assert found == "blocked EPERM"


@pytest.mark.parametrize("cls", [case(AREA, "plant a key in the trainer's session keyring", "OK")])
def test_no_key_can_be_planted(isolated, cls):
    name = f"sapo_planted_{uuid.uuid4().hex}"
    planted = run(
        f"attempt(lambda: libc.syscall(SYS['add_key'], b'user', {name.encode()!r}, b'x', 1, "
        f"{KEY_SPEC_SESSION_KEYRING}))"
    )
    assert planted == "blocked EPERM"
    assert find_session_key(name) == -1


@pytest.mark.parametrize("cls", [case(AREA, "host name, boot id and kernel command line", "OK")])
def test_host_name_boot_id_and_command_line_are_hidden(isolated, cls):
    seen = run(
        "import socket\nprint(socket.gethostname())\n"
        "print(repr(open('/proc/cmdline').read()), repr(open('/proc/sys/kernel/random/boot_id').read()))"
    )
    assert seen.splitlines() == ["sandbox", "'' ''"]
    assert socket.gethostname() != "sandbox"  # the host's is untouched


@pytest.mark.parametrize("cls", [case(AREA, "memfd memory over memory_mb", "OK")])
def test_memfd_is_refused(isolated, cls):
    code = "attempt(lambda: os.memfd_create('hold'))\nattempt(lambda: libc.syscall(319, b'x', 0))"
    assert run(code).splitlines() == ["blocked EPERM", "blocked EPERM"]


@pytest.mark.parametrize("cls", [case(AREA, "unbounded open files", "OK")])
def test_open_files_are_bounded(isolated, cls):
    limits = SandboxLimits(wall_s=20.0, max_open_files=64)
    assert run("attempt(lambda: [os.open('/dev/null', 0) for _ in range(1000)])", limits) == "blocked EMFILE"


@pytest.mark.parametrize("cls", [case(AREA, "one sandbox's fork bomb fails another's fork", "OK")])
def test_a_fork_bomb_does_not_fail_another_sandboxs_fork(isolated, cls):
    limits = SandboxLimits(wall_s=20.0, max_procs=8)
    bomb = "import os, time\nfor _ in range(20):\n    try:\n        os.fork() or time.sleep(6)\n    except OSError:\n        break\ntime.sleep(6)"
    other = "attempt(lambda: os.waitpid(os.fork() or os._exit(0), 0)[0] > 0)"
    results: dict[str, str] = {}
    first = threading.Thread(
        target=lambda: results.update(bomb=run_python({"b.py": bomb}, "b.py", limits=limits).stderr)
    )
    first.start()
    time.sleep(2.0)  # the bomb holds its max_procs processes
    results["other"] = run(other, limits)
    first.join()
    assert results["other"] == "reached True"
