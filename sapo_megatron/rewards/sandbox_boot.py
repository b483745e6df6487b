"""Sandbox launcher, run as ``python -I -S sandbox_boot.py SETTINGS_JSON`` by :mod:`.sandbox` (stdlib only).

In order: die with the parent (``PR_SET_PDEATHSIG``); new network, PID and mount namespaces where the kernel
allows (each one that fails is skipped and reported); then fork. The child – PID 1 of the new PID namespace, so
that when it exits the kernel kills every process it left behind – makes mount propagation private, enters the
work dir, mounts an empty private tmpfs over the world-writable ``/tmp``, ``/var/tmp`` and ``/dev/shm``, drops to
an unprivileged uid/gid when started as root (the work dir is then seen as ``/tmp/work``), sets the rlimits and ``exec``s ``python -I`` on the code. The
launcher waits and exits with the child's status (128 + signal when killed). With ``"probe": true`` it prints
what it managed as JSON instead of running code.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000
PR_SET_PDEATHSIG = 1
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")
VISIBLE_WORKDIR = "/tmp/work"
MS_BIND = 0x1000


def main() -> None:
    settings = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    isolation = {
        name: settings["namespaces"] and libc.unshare(flag) == 0
        for name, flag in (("net", CLONE_NEWNET), ("pid", CLONE_NEWPID), ("mount", CLONE_NEWNS))
    }
    isolation["private_tmp"] = False
    isolation["uid"] = os.geteuid()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            _child(settings, libc, isolation, write_end)
        except BaseException as exc:  # never fall through into the launcher's code
            os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
        os._exit(127)
    os.close(write_end)
    report = b""
    while chunk := os.read(read_end, 4096):
        report += chunk
    _, status = os.waitpid(pid, 0)
    if settings.get("probe"):
        os.write(1, report)
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


def _child(settings: dict, libc, isolation: dict, report_fd: int) -> None:
    os.chdir(settings["workdir"])
    if isolation["mount"] and libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0:
        options = f"size={settings['tmpfs_mb']}m,mode=1777".encode()
        isolation["private_tmp"] = all(
            libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) == 0
            for path in WORLD_WRITABLE
            if os.path.isdir(path)
        )
        # the work dir (now hidden if it was under /tmp) reappears as /tmp/work: bound from the cwd, which
        # still points at it
        os.mkdir(VISIBLE_WORKDIR)
        if libc.mount(b".", VISIBLE_WORKDIR.encode(), None, MS_BIND, None) != 0:
            raise OSError(ctypes.get_errno(), "cannot bind the work dir to " + VISIBLE_WORKDIR)
        os.chdir(VISIBLE_WORKDIR)
    uid = settings["uid"]
    if os.geteuid() == 0 and uid and settings["namespaces"]:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        isolation["uid"] = os.geteuid()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cleared by setuid: set again
    limits = settings["limits"]
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
    os.write(report_fd, json.dumps(isolation).encode())
    os.close(report_fd)
    if settings.get("probe"):
        os._exit(0)
    argv = [settings["python"], "-I", *settings["argv"]]
    os.execv(settings["python"], argv)


if __name__ == "__main__":
    main()
