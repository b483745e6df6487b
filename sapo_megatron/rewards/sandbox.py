"""Running untrusted code: a subprocess in its own session with rlimits, a wall timeout and, where the kernel
allows (root with CAP_SYS_ADMIN), its own network, PID, mount, IPC and UTS namespaces, a private root file
system, a fresh session keyring and an unprivileged uid of its own. docs/rewards.md ("The sandbox") lists what is and is not contained, with the test of each.

What contains what (``sandbox_boot.py`` does it, in this order):

- a new network namespace: only a loopback that is down, so every connection fails, 127.0.0.1 included;
- a new PID namespace with its own ``/proc``: the code sees only its own processes, and when the namespace's
  PID 1 exits the kernel kills every process the code left behind;
- a private root: an empty tmpfs holding read-only bind mounts of the interpreter, its standard library and
  site-packages, the shared libraries they load (:func:`readonly_set`), ``/dev/{null,zero,full,random,urandom}``
  and ``/etc/ld.so.cache``; then ``pivot_root`` and the old root detached. Nothing else of the machine is
  visible: no checkout, no home, no ``/run`` (so no Unix socket of a host daemon), no ``/etc``;
- a new IPC namespace (no host SysV shared memory, semaphore or message queue; what the code creates dies with
  it) and a new UTS namespace (host name ``sandbox``); ``/proc/cmdline`` and the boot id read as empty;
- one tmpfs of ``tmpfs_mb`` for all writes: ``/tmp`` (the work dir ``/tmp/work``), ``/var/tmp`` and ``/dev/shm``;
  the root itself is read-only;
- an unprivileged uid of its own among the trainer's concurrent sandboxes (:func:`_uid_slot`: ``100000 +
  (pid % 10000) * 100 + slot``, the checker's 2,000,000 above), so one run's processes never count against
  another's ``RLIMIT_NPROC``; no supplementary groups, ``no_new_privs``, a fresh empty session keyring;
- a seccomp filter: no new namespaces, no ``setns``, no kernel key store (``keyctl``, ``add_key``,
  ``request_key``), no ``memfd_create`` / ``memfd_secret`` (memory that ``RLIMIT_AS`` does not count);
- rlimits: CPU time ``RLIMIT_CPU`` (``cpu_s``), address space ``RLIMIT_AS`` (``memory_mb``), file size
  ``RLIMIT_FSIZE`` (``max_file_mb``: also bounds stdout / stderr, which go to files), processes ``RLIMIT_NPROC``
  (``max_procs``, per uid), open files ``RLIMIT_NOFILE`` (``max_open_files``), no core files; a wall-clock timeout (``wall_s``) that kills the process group;
- an environment of its own (``PATH``, ``LANG``, ``HOME``): none of the trainer's variables.

:func:`run_checked` runs test code against a solution so that the verdict cannot be forged: the solution runs in
one process, the tests in a second one under another uid (``sandbox_check.py``), which calls into the solution
over a pipe and only ever receives plain values. The verdict is written by the checker on a descriptor that only
it holds, after the last test statement ran.

Without the privileges for namespaces (not root, or a container without CAP_SYS_ADMIN) the code still runs with
the rlimits, its own session, its own environment and the wall timeout, but **with the machine's network and file
system** (as the trainer's user): :func:`isolation` says what is available and a warning is logged once;
``require_isolation=True`` makes that an error instead. ``SAPO_SANDBOX_NAMESPACES=0`` forces that fallback (for
tests, or a kernel whose namespaces misbehave).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import logging
import marshal
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)
BOOT = Path(__file__).with_name("sandbox_boot.py")
CHECKER = Path(__file__).with_name("sandbox_check.py")
ISOLATED = ("net", "pid", "ipc", "uts", "root", "private_tmp", "seccomp", "keyring")
"""What :func:`isolation` must report for ``require_isolation``."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    max_file_mb: int = 16
    max_procs: int = 32
    tmpfs_mb: int = 64
    max_output_bytes: int = 1 << 20
    max_open_files: int = 256


@dataclass(frozen=True)
class SandboxResult:
    returncode: int  # 128 + signal when killed by one; -1 on wall timeout
    stdout: str
    stderr: str
    timed_out: bool
    verdict: dict | None = None
    """:func:`run_checked` only: the checker's report, ``{"ok": bool, "value": ..., "error": str}``; None when
    the checker wrote none (it was killed, or timed out)."""


class LongInt:
    """A JSON integer longer than Python's 4,300-digit conversion limit, kept as its digits and compared exactly
    (the sandbox lifts the limit for the code; the trainer keeps it)."""

    __slots__ = ("digits",)

    def __init__(self, digits: str) -> None:
        self.digits = digits

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LongInt) and other.digits == self.digits

    def __hash__(self) -> int:
        return hash(self.digits)

    def __repr__(self) -> str:
        return f"LongInt({len(self.digits)} digits)"


def exact_int(text: str) -> int | LongInt:
    """``json.loads``'s ``parse_int``: an int, or a :class:`LongInt` past the conversion limit."""
    return int(text) if len(text.lstrip("-")) <= 4000 else LongInt(text)


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


_INTERPRETER_PATHS = """
import json, os, site, sys, sysconfig
paths = [sys.executable, sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib"), *site.getsitepackages()]
paths.append(os.path.join(sys.prefix, "pyvenv.cfg"))
dynload = [p for p in sys.path if os.path.basename(p) == "lib-dynload" and os.path.isdir(p)]
modules = [os.path.join(d, n) for d in dynload for n in os.listdir(d)]
with open("/proc/self/maps") as maps:  # what this interpreter has loaded: enough to start it even without ldd
    mapped = {line.split()[-1] for line in maps if ".so" in line and line.split()[-1].startswith("/")}
binaries = [os.path.realpath(sys.executable), *modules]
print(json.dumps({"paths": paths, "mapped": sorted(mapped), "binaries": binaries}))
"""


@functools.lru_cache(maxsize=4)
def readonly_set(python: str) -> tuple[str, ...]:
    """The paths the private root shows, read-only: the interpreter as named (symlinks kept), its standard
    library, its site-packages, its ``pyvenv.cfg`` if any, the directories of the shared libraries it has
    loaded and that its ``lib-dynload`` modules load (``ldd``, where installed), and ``/etc/ld.so.cache``. Paths
    that do not exist are left out."""
    done = subprocess.run(
        [python, "-I", "-c", _INTERPRETER_PATHS], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise SandboxUnavailable(
            f"the sandbox interpreter {python} does not start: {done.stderr.strip()[-300:]}"
        )
    found = json.loads(done.stdout)
    mapped = {os.path.dirname(path) for path in found["mapped"]}
    loader = _elf_interpreter(found["binaries"][0])
    paths = [python, *found["paths"], "/etc/ld.so.cache", *loader, *sorted(mapped)]
    paths += _library_dirs(found["binaries"])
    return tuple(dict.fromkeys(path for path in paths if os.path.lexists(path)))


def _elf_interpreter(path: str) -> list[str]:
    """The program interpreter (``PT_INTERP``, e.g. ``/lib64/ld-linux-x86-64.so.2``) a 64-bit little-endian ELF
    executable names, as a one-element list; empty for anything else (a static binary, another format)."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return []
            phoff, phentsize, phnum = (
                int.from_bytes(head[32:40], "little"),
                int.from_bytes(head[54:56], "little"),
                int.from_bytes(head[56:58], "little"),
            )
            for index in range(phnum):
                stream.seek(phoff + index * phentsize)
                header = stream.read(phentsize)
                if int.from_bytes(header[0:4], "little") == 3:  # PT_INTERP
                    offset, size = (
                        int.from_bytes(header[8:16], "little"),
                        int.from_bytes(header[32:40], "little"),
                    )
                    stream.seek(offset)
                    return [stream.read(size).rstrip(b"\0").decode()]
    except (OSError, UnicodeDecodeError):
        pass
    return []


def _library_dirs(binaries: list[str]) -> list[str]:
    """The directories of the shared libraries (and the loader) that ``binaries`` link, by ``ldd``."""
    if not shutil.which("ldd"):
        return []
    done = subprocess.run(["ldd", *binaries], capture_output=True, text=True, timeout=60, check=False)
    libraries, loaders = set(), set()
    for line in done.stdout.splitlines():
        words = line.split()
        if (
            "=>" in words
            and len(words) > words.index("=>") + 1
            and words[words.index("=>") + 1].startswith("/")
        ):
            libraries.add(os.path.dirname(words[words.index("=>") + 1]))
        elif len(words) == 2 and words[0].startswith("/") and words[1].startswith("(0x"):
            loaders.add(words[0])  # e.g. /lib64/ld-linux-x86-64.so.2 (a file header line ends with ":")
    return sorted(libraries | loaders)


def root_plan(paths: tuple[str, ...]) -> list[list[str]]:
    """How ``sandbox_boot.py`` builds the private root from host ``paths``: ``["dir", p]``, ``["link", p,
    target]`` and ``["bind", p]`` entries, parents first. Each symlink on the way to a path is recreated (so
    ``/lib64/ld-linux-x86-64.so.2`` resolves as on the host) and only the real file or directory at its end is
    bound; a path inside a bound directory needs nothing more."""
    kinds: dict[str, list[str]] = {}
    for path in paths:
        _walk(path, kinds, depth=0)
    binds = [p for p, entry in kinds.items() if entry[0] == "bind"]
    inside = {p for p in kinds for b in binds if p != b and p.startswith(b.rstrip("/") + "/")}
    return [kinds[p] for p in sorted(kinds) if p not in inside]


def _walk(path: str, kinds: dict[str, list[str]], depth: int) -> None:
    if depth > 40:
        raise SandboxUnavailable(f"too many symbolic links on the way to {path}")
    parts = Path(os.path.abspath(path)).parts[1:]
    current = "/"
    for index, part in enumerate(parts):
        current = os.path.join(current, part)
        if os.path.islink(current):
            target = os.readlink(current)
            kinds[current] = ["link", current, target]
            resolved = os.path.join(os.path.dirname(current), target)
            _walk(os.path.join(resolved, *parts[index + 1 :]), kinds, depth + 1)
            return
        if index == len(parts) - 1:
            kinds[current] = ["bind", current]
        elif kinds.get(current, ["dir"])[0] == "dir":
            kinds[current] = ["dir", current]


def _namespaces_wanted() -> bool:
    """``SAPO_SANDBOX_NAMESPACES=0`` runs without namespaces or uid change (as where the kernel refuses them)."""
    return os.environ.get("SAPO_SANDBOX_NAMESPACES", "1") != "0"


UID_SLOTS = 100
"""Concurrent sandboxes of one trainer process, each under a uid of its own; one more waits for a free uid."""
_slots = threading.Condition()
_busy: set[int] = set()


@contextlib.contextmanager
def _uid_slot() -> Iterator[int]:
    """A uid no other running sandbox of this process has (0 when the sandbox does not change uid):
    ``RLIMIT_NPROC`` counts a uid's processes machine-wide, so a shared uid let one run's fork bomb fail
    another's ``fork()``. Trainers whose pids agree modulo 10,000 share the range (documented)."""
    if os.geteuid() != 0 or not _namespaces_wanted():
        yield 0
        return
    with _slots:
        _slots.wait_for(lambda: len(_busy) < UID_SLOTS)
        slot = min(set(range(UID_SLOTS)) - _busy)
        _busy.add(slot)
    try:
        yield 100000 + (os.getpid() % 10000) * UID_SLOTS + slot
    finally:
        with _slots:
            _busy.discard(slot)
            _slots.notify()


def _settings(workdir: Path, limits: SandboxLimits, uid: int, **run: object) -> dict:
    python = sandbox_python()
    return {
        "workdir": str(workdir),
        "python": python,
        # only root builds the private root (mount, pivot_root): elsewhere no need to ask the interpreter
        "root_plan": root_plan(readonly_set(python)) if _namespaces_wanted() and os.geteuid() == 0 else [],
        "uid": uid,
        "checker_uid": uid + 2_000_000
        if uid
        else 0,  # never the solution's: it cannot signal or trace the checker
        "limits": {
            "RLIMIT_CPU": limits.cpu_s,
            "RLIMIT_AS": limits.memory_mb << 20,
            "RLIMIT_FSIZE": limits.max_file_mb << 20,
            "RLIMIT_NPROC": limits.max_procs,
            "RLIMIT_CORE": 0,
            "RLIMIT_NOFILE": limits.max_open_files,
        },
        "tmpfs_mb": limits.tmpfs_mb,
        "namespaces": _namespaces_wanted(),
        "files": {},
        "argv": [],
        "check": None,
        "probe": False,
        **run,
    }


@functools.lru_cache(maxsize=1)
def isolation() -> dict[str, object]:
    """What the sandbox manages here: ``{"net", "pid", "mount", "root", "proc", "private_tmp": bool, "uid":
    int}`` (one probe run per process); logs a warning once when the code would see the network or the file
    system."""
    try:
        found = ast.literal_eval(_run(SandboxLimits(wall_s=30.0), probe=True).stdout)
    except (ValueError, SyntaxError, SandboxUnavailable, subprocess.SubprocessError, OSError):
        found = {}
    found = {
        key: bool(found.get(key))
        for key in ("net", "pid", "mount", "ipc", "uts", "root", "proc", "private_tmp", "seccomp", "keyring")
    } | {"uid": found.get("uid", os.geteuid())}
    if not (all(found[key] for key in ISOLATED) and found["uid"] != 0):
        logger.warning(
            "code sandbox without full isolation here (%s): untrusted code keeps the machine's network and/or "
            "file system; run the trainer as root with CAP_SYS_ADMIN for network / PID / mount namespaces",
            ", ".join(f"{k}={v}" for k, v in found.items()),
        )
    return found


def _require(require_isolation: bool) -> None:
    found = isolation()  # the warning, once
    if require_isolation and not all(found[key] for key in ISOLATED):
        raise SandboxUnavailable(f"the code sandbox cannot isolate the code here: {found}")


def run_python(
    files: dict[str, str],
    script: str,
    stdin: str = "",
    limits: SandboxLimits = SandboxLimits(),
    *,
    require_isolation: bool = False,
) -> SandboxResult:
    """Write ``files`` into a fresh work dir and run ``python -I script`` there under the limits above."""
    _require(require_isolation)
    return _run(limits, files=files, argv=[script], stdin=stdin)


def run_checked(
    files: dict[str, str],
    test: str,
    limits: SandboxLimits = SandboxLimits(),
    *,
    require_isolation: bool = False,
) -> SandboxResult:
    """Load ``files["solution.py"]`` as the module ``solution`` in one sandboxed process and run the Python
    ``test`` in a second one (``sandbox_check.py``) with the solution's names bound to proxies. The result's
    ``verdict`` is the checker's: ``ok`` only when every statement of ``test`` ran; ``value`` what the test
    passed to ``__report__``."""
    _require(require_isolation)
    return _run(limits, files=files, check=test, checker=CHECKER.read_text())


def _run(limits: SandboxLimits, stdin: str = "", **run: object) -> SandboxResult:
    with _uid_slot() as uid:
        return _run_as(uid, limits, stdin, **run)


def _run_as(uid: int, limits: SandboxLimits, stdin: str = "", **run: object) -> SandboxResult:
    root = Path(tempfile.mkdtemp(prefix="sapo-sandbox-"))
    try:
        workdir = root / "work"
        workdir.mkdir()
        (root / "fs").mkdir()  # the private root's mount point
        if uid:
            os.chown(workdir, uid, uid)
            root.chmod(0o711)  # without a private root the code's uid reaches its work dir through this one
        (root / "stdin").write_text(stdin)
        settings = marshal.dumps(_settings(workdir, limits, uid, **run))
        settings_read, settings_write = os.pipe()
        verdict_read, verdict_write = os.pipe()
        with (
            open(root / "stdin", "rb") as inp,
            open(root / "out", "wb") as out,
            open(root / "err", "wb") as err,
        ):
            try:
                process = subprocess.Popen(
                    [sys.executable, "-I", "-S", str(BOOT), str(settings_read), str(verdict_write)],
                    stdin=inp,
                    stdout=out,
                    stderr=err,
                    pass_fds=(settings_read, verdict_write),
                    start_new_session=True,
                )
            finally:
                os.close(settings_read)
                os.close(verdict_write)
            verdict = _Reader(verdict_read, limits.max_output_bytes)
            timed_out = False
            try:
                _send(settings_write, settings)
                returncode = process.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out, returncode = True, -1
            finally:
                _kill_group(process)
        return SandboxResult(
            returncode,
            _head(root / "out", limits),
            _head(root / "err", limits),
            timed_out,
            verdict.result() if "check" in run else None,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _send(fd: int, data: bytes) -> None:
    """The settings, on a pipe the launcher reads first (a file would be readable by the code in the fallback
    without namespaces, and the checker's tests are in them)."""
    try:
        with open(fd, "wb") as stream:
            stream.write(data)
    except BrokenPipeError:
        pass  # the launcher died first; its exit status says so


class _Reader:
    """Reads the checker's verdict pipe to its end in a thread (so a large report cannot block the checker),
    keeping at most ``cap`` bytes."""

    def __init__(self, fd: int, cap: int) -> None:
        self.data, self._fd, self._cap = b"", fd, cap
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with open(self._fd, "rb") as stream:
            while chunk := stream.read(65536):
                if len(self.data) <= self._cap:
                    self.data += chunk

    def result(self) -> dict | None:
        self._thread.join(timeout=5)
        if len(self.data) > self._cap:
            return {"ok": False, "error": f"the checker's report is over {self._cap} bytes"}
        try:
            verdict = json.loads(self.data, parse_int=exact_int)
        except ValueError:
            return None
        return verdict if isinstance(verdict, dict) else None


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _head(path: Path, limits: SandboxLimits) -> str:
    with open(path, "rb") as stream:
        return stream.read(limits.max_output_bytes).decode(errors="replace")
