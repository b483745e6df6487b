"""Sandbox launcher, run as ``python -I -S sandbox_boot.py SETTINGS_FD VERDICT_FD`` by :mod:`.sandbox` (stdlib
only). It reads its settings (a marshalled dict) from the pipe ``SETTINGS_FD``; ``VERDICT_FD`` goes to the checker alone.

In order: die with the parent (``PR_SET_PDEATHSIG``) and stay untraceable (``PR_SET_DUMPABLE`` 0); new network,
PID, mount, IPC (SysV shared memory, semaphores, message queues) and UTS (host name) namespaces where the kernel
allows (each one that fails is skipped and reported); then fork. The
child – PID 1 of the new PID namespace, so that when it exits the kernel kills every process it left behind –
makes mount propagation private and builds the private root (:func:`_build_root`): a tmpfs with the read-only set
bound in, a fresh ``/proc`` (``/proc/cmdline`` and the boot id blanked), a few device nodes, one size-capped tmpfs for ``/tmp`` (work dir ``/tmp/work``),
``/var/tmp`` and ``/dev/shm``; ``pivot_root`` into it, the old root detached, the new root remounted read-only.
It writes the files into the work dir, then either ``exec``s ``python -I`` on the code as an unprivileged uid with
the rlimits, a fresh session keyring and the seccomp filter, or (a check run) starts the solution's host and the checker (``sandbox_check.py``) under two
different uids, feeds the checker its tests and waits for it. The launcher waits and exits with the child's
status (128 + signal when killed). With ``"probe": true`` it prints what it managed (a dict's ``repr``) instead.
"""

import ctypes
import marshal
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
CLONE_NEWIPC, CLONE_NEWUTS = 0x08000000, 0x04000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x1, 0x2, 0x4, 0x8, 0x20
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
# per machine: the audit architecture and the numbers of the system calls the filter looks at
SECCOMP_ARCH = {
    "x86_64": (
        0xC000003E,
        {
            "clone": 56,
            "clone3": 435,
            "unshare": 272,
            "setns": 308,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "memfd_create": 319,
            "memfd_secret": 447,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "clone": 220,
            "clone3": 435,
            "unshare": 97,
            "setns": 268,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "memfd_create": 279,
            "memfd_secret": 447,
        },
    ),
}
REFUSED = ("setns", "add_key", "request_key", "keyctl", "memfd_create", "memfd_secret")
"""System calls the code never gets (EPERM): joining another namespace, the kernel's key store (the trainer's
session keyring holds credentials), and anonymous memory files (``memfd_create``: their pages are not counted by
``RLIMIT_AS``, so they would hold memory past ``memory_mb``)."""
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1
HIDDEN = ("/proc/cmdline", "/proc/sys/kernel/random/boot_id")
"""Host facts the fresh ``/proc`` still shows: covered by ``/dev/null`` (empty)."""
NEW_NAMESPACES = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
WORKDIR = "/tmp/work"
DEVICES = ("null", "zero", "full", "random", "urandom")
ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": WORKDIR}
"""The code's whole environment: none of the trainer's variables (tokens, keys) reach it."""


def main() -> None:
    settings_fd, verdict_fd = int(sys.argv[1]), int(sys.argv[2])
    with open(settings_fd, "rb") as stream:
        settings = marshal.loads(stream.read())  # from the trainer (marshal: json would cost an import of re)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    isolation = {
        name: settings["namespaces"] and libc.unshare(flag) == 0
        for name, flag in (
            ("net", CLONE_NEWNET),
            ("pid", CLONE_NEWPID),
            ("mount", CLONE_NEWNS),
            ("ipc", CLONE_NEWIPC),
            ("uts", CLONE_NEWUTS),
        )
    }
    if isolation["uts"]:
        libc.sethostname(b"sandbox", 7)
    isolation.update(root=False, proc=False, private_tmp=False, uid=os.geteuid())
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            _child(settings, libc, isolation, write_end, verdict_fd)
        except BaseException as exc:  # never fall through into the launcher's code
            os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
        os._exit(127)
    os.close(write_end)
    os.close(verdict_fd)
    report = b""
    while chunk := os.read(read_end, 4096):
        report += chunk
    _, status = os.waitpid(pid, 0)
    if settings.get("probe"):
        os.write(1, report)
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


def _child(settings: dict, libc, isolation: dict, report_fd: int, verdict_fd: int) -> None:
    workdir = settings["workdir"]
    if isolation["mount"] and settings["root_plan"] and _mount(libc, "none", "/", None, MS_REC | MS_PRIVATE):
        try:
            _build_root(settings, libc)
        except OSError as exc:  # e.g. a root file system pivot_root refuses: the probe reports root=False
            os.write(
                2, f"sandbox: no private root here ({exc}); the code sees the machine's files\n".encode()
            )
            os.chdir(workdir)
        else:
            isolation.update(root=True, proc=True, private_tmp=True)
            workdir = WORKDIR
    uid = settings["uid"] if os.geteuid() == 0 and settings["namespaces"] else 0
    for name, text in settings["files"].items():
        path = os.path.join(workdir, os.path.basename(name))
        with open(path, "w", encoding="utf-8") as stream:
            stream.write(text)
        if uid:
            os.chown(path, uid, uid)
    os.chdir(workdir)
    isolation["uid"] = uid or os.geteuid()
    if settings.get("probe"):
        isolation["keyring"] = _fresh_session_keyring(libc)
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        isolation["seccomp"] = _no_new_namespaces(libc)
        os.write(report_fd, repr(isolation).encode())
        os._exit(0)
    os.write(report_fd, repr(isolation).encode())
    os.close(report_fd)
    python = settings["python"]
    if settings["check"] is not None:
        _check(settings, libc, uid, verdict_fd)
    os.close(verdict_fd)
    # the code runs as this process's child, not as PID 1 itself: its parent is then root and untraceable,
    # and it gets the signal semantics of an ordinary process
    code = _spawn(libc, uid, settings["limits"], [python, "-I", *settings["argv"]], keep=(), stdin=True)
    _, status = os.waitpid(code, 0)
    status = os.waitstatus_to_exitcode(status)
    os._exit(128 - status if status < 0 else status)


def _build_root(settings: dict, libc) -> None:
    """The private root at ``settings["workdir"]/../fs``: a small tmpfs holding only the read-only set; then
    ``pivot_root`` into it (the host's tree detached) and the root remounted read-only."""
    new = os.path.join(os.path.dirname(settings["workdir"]), "fs")
    _mount(libc, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755", check=True)
    for entry in settings["root_plan"]:
        target = new + entry[1]
        if entry[0] == "dir":
            os.makedirs(target, mode=0o755, exist_ok=True)
        elif entry[0] == "link":
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            os.symlink(entry[2], target)
        else:
            _bind_readonly(libc, entry[1], target)
    for name in ("proc", "dev", "tmp", "var", "run", "etc"):
        os.makedirs(os.path.join(new, name), mode=0o755, exist_ok=True)
    _mount(libc, "proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, check=True)
    for path in HIDDEN:
        if os.path.exists(new + path):
            _mount(libc, "/dev/null", new + path, None, MS_BIND, check=True)
    for device in DEVICES:
        _bind_node(libc, "/dev/" + device, new + "/dev/" + device)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
    ):
        os.symlink(target, f"{new}/dev/{name}")
    os.symlink("/proc/self/fd/2", new + "/dev/stderr")
    os.symlink("/tmp", new + "/dev/shm")
    os.symlink("/tmp", new + "/var/tmp")
    options = f"size={settings['tmpfs_mb']}m,mode=1777,nr_inodes=4096"
    _mount(libc, "tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, options, check=True)
    os.mkdir(new + WORKDIR, 0o700)
    if settings["uid"] and os.geteuid() == 0:
        os.chown(new + WORKDIR, settings["uid"], settings["uid"])
    os.chdir(new)
    _pivot_root(libc)
    _mount(libc, None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, check=True)


def _bind_readonly(libc, source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        open(target, "w").close()
    _mount(libc, source, target, None, MS_BIND, check=True)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    _mount(libc, None, target, None, flags, check=True)


def _bind_node(libc, source: str, target: str) -> None:
    open(target, "w").close()
    _mount(libc, source, target, None, MS_BIND, check=True)
    _mount(libc, None, target, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC, check=True)


def _pivot_root(libc) -> None:
    """``pivot_root(".", ".")`` puts the old root on top of the new one; detaching it leaves only the new."""
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(f"no pivot_root system call number known for {os.uname().machine}")
    if libc.syscall(number, b".", b".") != 0:
        raise OSError(ctypes.get_errno(), "pivot_root failed")
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "cannot detach the old root")
    os.chdir("/")


def _mount(libc, source, target, fstype, flags: int, data: str | None = None, *, check: bool = False) -> bool:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    ok = libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) == 0
    if check and not ok:
        raise OSError(ctypes.get_errno(), f"mount {source} on {target} failed")
    return ok


def _become(libc, uid: int, limits: dict) -> None:
    """Drop to ``uid`` (when started as root), then no new privileges and the rlimits."""
    if os.geteuid() == 0 and uid:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cleared by setuid: set again
    _fresh_session_keyring(libc)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _no_new_namespaces(libc)
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))


def _fresh_session_keyring(libc) -> bool:
    """Join a new, empty session keyring: the trainer's (inherited across fork and exec) is out of reach even
    where the seccomp filter is not available."""
    number = SYS_KEYCTL.get(os.uname().machine)
    return number is not None and libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None) >= 0


def _no_new_namespaces(libc) -> bool:
    """A seccomp filter: ``unshare`` / ``clone`` with a namespace flag fail with EPERM, and so do the calls of
    :data:`REFUSED`; ``clone3`` (whose flags a filter cannot read) fails with ENOSYS, so that libc falls back to
    ``clone``; another architecture's system calls kill the process. Without it an unprivileged user namespace
    would give the code its own mounts (a tmpfs of any size). False where the machine is not in
    :data:`SECCOMP_ARCH`."""
    if os.uname().machine not in SECCOMP_ARCH:
        return False
    audit, number = SECCOMP_ARCH[os.uname().machine]
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38
    load, equal, at_least, any_bit, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    refused = [number[name] for name in REFUSED]
    n = len(refused)
    # a jump's offset counts from the next instruction: target - (index + 1)
    flags, to_eperm, to_enosys = 9 + n, 12 + n, 13 + n  # the flags check and the two returns
    program = [
        (load, 0, 0, 4),  # 0: the architecture
        (equal, 1, 0, audit),  # 1
        (ret, 0, 0, kill),  # 2
        (load, 0, 0, 0),  # 3: the system call number
        (at_least, to_eperm - 5, 0, 0x40000000),  # 4: x32 calls on x86_64
        (equal, to_enosys - 6, 0, number["clone3"]),  # 5
        *((equal, to_eperm - (7 + i), 0, nr) for i, nr in enumerate(refused)),  # 6 .. 5 + n
        (equal, flags - (7 + n), 0, number["unshare"]),  # 6 + n
        (equal, flags - (8 + n), 0, number["clone"]),  # 7 + n
        (ret, 0, 0, allow),  # 8 + n
        (load, 0, 0, 16),  # 9 + n: the low half of the first argument, the flags
        (any_bit, 1, 0, NEW_NAMESPACES),  # 10 + n -> 12 + n
        (ret, 0, 0, allow),  # 11 + n
        (ret, 0, 0, eperm),  # 12 + n
        (ret, 0, 0, enosys),  # 13 + n
    ]

    class Instruction(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_ushort),
            ("jt", ctypes.c_ubyte),
            ("jf", ctypes.c_ubyte),
            ("k", ctypes.c_uint),
        ]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Instruction))]

    instructions = (Instruction * len(program))(*(Instruction(*step) for step in program))
    fprog = Program(len(program), instructions)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "cannot install the seccomp filter")
    return True


def _check(settings: dict, libc, uid: int, verdict_fd: int) -> None:
    """Two processes: the solution's host (uid) and the checker (another uid, the only holder of the verdict
    descriptor), joined by two pipes; the checker reads its tests from a third. This process (root, PID 1 of the
    namespace) feeds the tests, waits for the checker, then ends the host; its exit ends what the host left."""
    requests, replies, tests = os.pipe(), os.pipe(), os.pipe()
    source = settings["checker"]
    python = settings["python"]
    host_argv = [python, "-I", "-c", source, "host", str(requests[0]), str(replies[1]), "solution.py"]
    host = _spawn(
        libc, uid, settings["limits"], host_argv, keep=(requests[0], replies[1]), close=(verdict_fd,)
    )
    checker_uid = settings["checker_uid"] if uid else 0
    # -S: the checker needs the standard library only, and runs no site-packages .pth code
    check_argv = [python, "-I", "-S", "-c", source, "check", str(requests[1]), str(replies[0]), str(tests[0])]
    keep = (requests[1], replies[0], tests[0], verdict_fd)
    checker = _spawn(
        libc, checker_uid, settings["limits"], [*check_argv, str(verdict_fd)], keep=keep, cwd="/"
    )
    for fd in (*requests, *replies, tests[0], verdict_fd):
        os.close(fd)
    try:
        with open(tests[1], "w", encoding="utf-8") as stream:
            stream.write(settings["check"])
    except BrokenPipeError:
        pass  # the checker died first: it wrote no verdict
    _, status = os.waitpid(checker, 0)
    os.kill(host, signal.SIGKILL)
    os.waitpid(host, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _spawn(
    libc,
    uid: int,
    limits: dict,
    argv: list,
    *,
    keep: tuple,
    close: tuple = (),
    cwd: str = ".",
    stdin: bool = False,
) -> int:
    """Fork; in the child keep only 0-2 and ``keep`` open across ``exec`` (stdin: /dev/null unless ``stdin``),
    become ``uid`` with the limits and run ``argv``."""
    pid = os.fork()
    if pid:
        return pid
    try:
        for fd in close:
            os.close(fd)
        for fd in keep:
            os.set_inheritable(fd, True)
        if not stdin:
            os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
        os.chdir(cwd)
        _become(libc, uid, limits)
        os.execve(argv[0], argv, ENVIRONMENT)
    except BaseException as exc:
        os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
    os._exit(127)


if __name__ == "__main__":
    main()
