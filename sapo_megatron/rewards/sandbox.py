"""Running untrusted code: a subprocess in its own session with rlimits, a wall timeout, a fresh temporary work
dir, and (where the kernel allows) its own network, PID and mount namespaces and an unprivileged uid.

What contains what (see ``sandbox_boot.py`` for the order):

- CPU time ``RLIMIT_CPU`` (``cpu_s``), address space ``RLIMIT_AS`` (``memory_mb``), file size ``RLIMIT_FSIZE``
  (``max_file_mb``: also bounds stdout / stderr, which go to files), processes ``RLIMIT_NPROC`` (``max_procs``,
  counted per uid: effective because the code runs as its own uid, see below), no core files;
- a wall-clock timeout (``wall_s``): the launcher's process group is killed with SIGKILL; in a PID namespace
  that kills every process the code started, even ones that left the group (the kernel ends a namespace with
  its PID 1);
- a new network namespace: only a loopback that is down, so every connection fails, 127.0.0.1 included;
- the interpreter of :func:`sandbox_python` (``python -I``: no user site, no ``PYTHONPATH``);
- a mount namespace with private, empty tmpfs over ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (``tmpfs_mb``), the
  code running in a fresh temporary directory and, when the trainer runs as root, as an unprivileged uid
  (``60000 + pid % 5000``) that cannot write anywhere else.

Without the privileges for namespaces (not root, or a container without CAP_SYS_ADMIN) the code still runs with
the rlimits, its own session and the wall timeout, but **with the machine's network and file system** (as the
trainer's user): :func:`isolation` says what is available and a warning is logged once; ``require_isolation=True``
makes that an error instead. ``SAPO_SANDBOX_NAMESPACES=0`` forces that fallback (for tests, or a kernel whose
namespaces misbehave).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)
BOOT = Path(__file__).with_name("sandbox_boot.py")


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    max_file_mb: int = 16
    max_procs: int = 32
    tmpfs_mb: int = 64
    max_output_bytes: int = 1 << 20


@dataclass(frozen=True)
class SandboxResult:
    returncode: int  # 128 + signal when killed by one; -1 on wall timeout
    stdout: str
    stderr: str
    timed_out: bool


class SandboxUnavailable(RuntimeError):
    """Isolation was required and the kernel does not allow it here."""


def _reachable_by_others(path: Path) -> bool:
    """Every directory above ``path`` can be entered, and ``path`` itself read, by any user."""
    path = path.resolve()
    try:
        if not path.stat().st_mode & 0o004:
            return False
        return all(parent.stat().st_mode & 0o001 for parent in path.parents)
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def sandbox_python() -> str:
    """The interpreter the code runs with: ``$SAPO_SANDBOX_PYTHON``; else the trainer's when the unprivileged
    sandbox uid can read it and its standard library; else the system's ``python3``; else the trainer's."""
    if os.environ.get("SAPO_SANDBOX_PYTHON"):
        return os.environ["SAPO_SANDBOX_PYTHON"]
    own = Path(sys.executable)
    stdlib = Path(os.__file__)
    if os.geteuid() != 0 or (_reachable_by_others(own) and _reachable_by_others(stdlib)):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if Path(candidate).exists() and _reachable_by_others(Path(candidate)):
            return candidate
    return sys.executable


def _namespaces_wanted() -> bool:
    """``SAPO_SANDBOX_NAMESPACES=0`` runs without namespaces or uid change (as where the kernel refuses them)."""
    return os.environ.get("SAPO_SANDBOX_NAMESPACES", "1") != "0"


def _sandbox_uid() -> int:
    return 60000 + os.getpid() % 5000 if os.geteuid() == 0 and _namespaces_wanted() else 0


def _settings(workdir: Path, argv: list[str], limits: SandboxLimits, *, probe: bool = False) -> str:
    rlimits = {
        "RLIMIT_CPU": limits.cpu_s,
        "RLIMIT_AS": limits.memory_mb << 20,
        "RLIMIT_FSIZE": limits.max_file_mb << 20,
        "RLIMIT_NPROC": limits.max_procs,
        "RLIMIT_CORE": 0,
    }
    return json.dumps(
        {
            "workdir": str(workdir),
            "argv": argv,
            "python": sandbox_python(),
            "uid": _sandbox_uid(),
            "limits": rlimits,
            "tmpfs_mb": limits.tmpfs_mb,
            "probe": probe,
            "namespaces": _namespaces_wanted(),
        }
    )


@functools.lru_cache(maxsize=1)
def isolation() -> dict[str, object]:
    """What the sandbox manages here: ``{"net", "pid", "mount", "private_tmp": bool, "uid": int}`` (one probe
    run per process); logs a warning once when the code would see the network or the file system."""
    with tempfile.TemporaryDirectory(prefix="sapo-sandbox-probe-") as tmp:
        workdir = _make_workdir(Path(tmp))
        settings = _settings(workdir, [], SandboxLimits(), probe=True)
        done = subprocess.run(
            [sys.executable, "-I", "-S", str(BOOT), settings], capture_output=True, timeout=30, check=False
        )
    try:
        found = json.loads(done.stdout)
    except ValueError:
        found = {"net": False, "pid": False, "mount": False, "private_tmp": False, "uid": os.geteuid()}
    if not (found["net"] and found["pid"] and found["private_tmp"] and found["uid"] != 0):
        logger.warning(
            "code sandbox without full isolation here (%s): untrusted code keeps the machine's network and/or "
            "file system; run the trainer as root with CAP_SYS_ADMIN for network / PID / mount namespaces",
            ", ".join(f"{k}={v}" for k, v in found.items()),
        )
    return found


def _make_workdir(root: Path) -> Path:
    workdir = root / "work"
    workdir.mkdir()
    uid = _sandbox_uid()
    if uid:
        os.chown(workdir, uid, uid)
    return workdir


def run_python(
    files: dict[str, str],
    script: str,
    stdin: str = "",
    limits: SandboxLimits = SandboxLimits(),
    *,
    require_isolation: bool = False,
) -> SandboxResult:
    """Write ``files`` into a fresh work dir and run ``python -I script`` there under the limits above."""
    if require_isolation and not all(isolation()[k] for k in ("net", "pid", "private_tmp")):
        raise SandboxUnavailable(f"the code sandbox cannot isolate the code here: {isolation()}")
    isolation()  # the warning, once
    root = Path(tempfile.mkdtemp(prefix="sapo-sandbox-"))
    try:
        workdir = _make_workdir(root)
        for name, text in files.items():
            (workdir / name).write_text(text)
        (root / "stdin").write_text(stdin)
        with (
            open(root / "stdin", "rb") as inp,
            open(root / "out", "wb") as out,
            open(root / "err", "wb") as err,
        ):
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(BOOT), _settings(workdir, [script], limits)],
                stdin=inp,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            timed_out = False
            try:
                returncode = process.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out, returncode = True, -1
            finally:
                _kill_group(process)
        return SandboxResult(returncode, _head(root / "out", limits), _head(root / "err", limits), timed_out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _head(path: Path, limits: SandboxLimits) -> str:
    with open(path, "rb") as stream:
        return stream.read(limits.max_output_bytes).decode(errors="replace")
