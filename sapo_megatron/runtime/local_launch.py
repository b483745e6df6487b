"""Run a multi-process job on this machine: one process per rank with the environment ``torchrun`` gives its
workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), each
signal forwarded once to every rank, and the ranks' exit status as ours.

Why not ``torchrun`` for this (measured with torch 2.13, 2 workers): it forwards SIGINT/SIGTERM once to each
worker and waits for them (30 s, then SIGKILL), but then always exits 1 with a ``SignalException`` traceback
(25 lines; 50 after a second signal) and ``W... Sending process ... closing signal`` log lines, so an
interrupted run's status 130 is lost; SIGUSR1 (SLURM's pre-timeout signal) is not in its default handled set
and kills it, orphaning the workers; and the previous ``subprocess.call(torchrun)`` parent SIGKILLed it 0.25 s
after a Ctrl-C, leaving the workers running on their own. Multi-node jobs still start under ``torchrun``
(``launch/slurm_train.sbatch``).

The rendezvous store is hosted by this launcher, as torchrun's agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``):
it binds a port the kernel picks and holds it for the whole job, so nothing can take the port between choosing it
and rank 0 binding it. (Choosing a free port and letting rank 0 bind it seconds later, after its imports, lost
that race once in CI under pytest-xdist: rank 1 reached another process on the port, "Connection reset by peer".)

The ranks run in their own sessions, so a terminal's Ctrl-C reaches only this process, which forwards it: every
rank sees each signal exactly once. When a rank fails, the others get ``settle_s`` to finish on their own (they
usually fail too, or print nothing), then SIGTERM, and SIGKILL after ``grace_s``.

Which rank failed first is decided by when each rank *failed*, not when its process ended: a failing rank's
interpreter teardown closes its gloo sockets before the process is gone, so a peer can fail on that, and end,
before the rank that caused it. Each rank's command line calls :func:`note_failure` as it returns a non-zero status
(the time goes to a file in the launcher's temporary folder, as torchrun's error files carry theirs); a rank that
left no note counts from its process's end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

FORWARDED: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
FAILURE_DIR_ENV = "SAPO_LAUNCH_FAILURE_DIR"
"""Where a rank started by :func:`launch_local` notes when it failed (:func:`note_failure`)."""


def note_failure() -> None:
    """Record when this rank failed, for the launcher that started it (a no-op otherwise); call it as the failure
    is known, before the interpreter's teardown closes the rank's connections to its peers."""
    directory, rank = os.environ.get(FAILURE_DIR_ENV), os.environ.get("RANK", "")
    if not directory or not rank.isdigit():
        return
    with contextlib.suppress(OSError):
        (Path(directory) / f"rank{rank}").write_text(
            repr(time.monotonic())
        )  # CLOCK_MONOTONIC: one per machine


def rank_env(
    rank: int, world_size: int, port: int, failure_dir: str | None = None, *, agent_store: bool = False
) -> dict[str, str]:
    """The environment of local rank ``rank`` (what torchrun sets, for one node), and where it notes a failure;
    with ``agent_store`` every rank joins the store the launcher hosts on ``port`` as a client."""
    env = dict(os.environ)
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if agent_store:  # read by torch.distributed.rendezvous._create_c10d_store
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    if failure_dir is not None:
        env[FAILURE_DIR_ENV] = failure_dir
    env.setdefault(
        "OMP_NUM_THREADS", "1"
    )  # torchrun's default too: N processes must not each take every core
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return env


def launch_local(
    command: Sequence[str],
    nprocs: int,
    *,
    port: int | None = None,
    settle_s: float = 5.0,
    grace_s: float = 30.0,
) -> int:
    """Run ``command`` as ``nprocs`` ranks; returns the exit status of the rank that failed first (the root
    cause; a rank killed by signal N counts as 128 + N), or 0 when all succeed. Without ``port`` this process
    hosts the ranks' rendezvous store (see the module's text); with one, rank 0 hosts it there."""
    store = _agent_store(nprocs) if port is None else None
    store_port = store.port if store is not None else port
    assert store_port is not None
    with tempfile.TemporaryDirectory(prefix="sapo-launch-") as failure_dir:
        envs = [
            rank_env(rank, nprocs, store_port, failure_dir, agent_store=store is not None)
            for rank in range(nprocs)
        ]
        return _launch(command, envs, settle_s=settle_s, grace_s=grace_s, failure_dir=failure_dir)


def _agent_store(nprocs: int):
    """A TCP store on 127.0.0.1 at a port the kernel picks, served from a thread of this process until it ends."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False)


def _launch(
    command: Sequence[str], envs: list[dict[str, str]], *, settle_s: float, grace_s: float, failure_dir: str
) -> int:
    procs = [subprocess.Popen(list(command), env=env, start_new_session=True) for env in envs]

    def forward(signum: int, frame: FrameType | None) -> None:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        first_failed, stopped = _wait(
            procs, settle_s=settle_s, grace_s=grace_s, failure_dir=Path(failure_dir)
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs:  # only reached with live ranks if this process itself fails
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return _exit_status([proc.returncode for proc in procs], first_failed, stopped)


def _wait(
    procs: list[subprocess.Popen], *, settle_s: float, grace_s: float, failure_dir: Path
) -> tuple[int | None, set[int]]:
    """Wait for every rank; stop the others when one fails. Returns (the rank that failed first, or ``None``;
    the ranks this function signalled)."""
    ended: dict[int, float] = {}  # rank -> when its process ended, taken by a thread blocked in wait()

    def watch(rank: int, proc: subprocess.Popen) -> None:
        proc.wait()
        ended[rank] = time.monotonic()

    for rank, proc in enumerate(procs):
        threading.Thread(target=watch, args=(rank, proc), daemon=True).start()
    failed_at: float | None = None
    terminated_at: float | None = None
    stopped: set[int] = set()
    while len(ended) < len(procs):
        now = time.monotonic()
        if failed_at is None and any(procs[rank].returncode for rank in ended):
            failed_at = now
        if failed_at is not None and terminated_at is None and now - failed_at > settle_s:
            terminated_at = now
            stopped |= _signal_alive(procs, signal.SIGTERM)
        if terminated_at is not None and now - terminated_at > grace_s:
            stopped |= _signal_alive(procs, signal.SIGKILL)
        time.sleep(0.05)
    failed = sorted(
        (_noted_failure(failure_dir, rank, when), rank)
        for rank, when in ended.items()
        if procs[rank].returncode
    )
    return (failed[0][1] if failed else None), stopped


def _noted_failure(failure_dir: Path, rank: int, ended_at: float) -> float:
    """When ``rank`` noted its failure (:func:`note_failure`), else when its process ended."""
    try:
        noted = float((failure_dir / f"rank{rank}").read_text()[:64])
    except (OSError, ValueError):
        return ended_at
    return min(noted, ended_at)


def _signal_alive(procs: list[subprocess.Popen], sig: signal.Signals) -> set[int]:
    signalled = set()
    for rank, proc in enumerate(procs):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
                signalled.add(rank)
    return signalled


def _exit_status(codes: list[int], first_failed: int | None, stopped: set[int]) -> int:
    statuses = [128 - code if code < 0 else code for code in codes]
    for rank, code in enumerate(codes):
        # A rank killed by a signal that neither the user nor this launcher sent could not say why itself.
        if code < 0 and rank not in stopped and -code not in FORWARDED:
            print(f"sapo-megatron: rank {rank} was killed by {signal.Signals(-code).name}", file=sys.stderr)
    return 0 if first_failed is None else statuses[first_failed]
