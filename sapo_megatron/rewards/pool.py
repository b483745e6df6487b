"""A pool of reward worker processes with a per-call timeout; a worker that hangs or dies is replaced.

Each worker is a fresh ``python -m sapo_megatron.rewards.worker`` (the spawn way: never a fork of the trainer,
whose torch threads make forking unsafe) in its own session, so that killing its process group also ends what
the reward started. One unit of work (a sample, or a group for group rewards) at a time per worker. A unit that
runs past ``timeout_s`` gets its worker killed (SIGKILL to the process group) and scores 0.0 with an error; so
does a unit whose worker dies. A new worker then starts in its place, in the background.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sapo_megatron.rewards.framing import read_frame, write_frame
from sapo_megatron.rewards.types import RewardError, RewardInput, RewardOutput

STARTUP_TIMEOUT_S = 120.0


class PoolError(RewardError):
    """The workers cannot start (the reward does not import in a fresh process)."""

    hint = (
        "the reward must import in a fresh `python -m sapo_megatron.rewards.worker` (no state from the trainer); "
        "or set algorithm.reward_workers: 0 to score inline"
    )


@dataclass
class _Worker:
    process: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    task: int | None = None
    deadline: float = 0.0

    @property
    def fd(self) -> int:
        assert self.process.stdout is not None
        return self.process.stdout.fileno()

    def send(self, message: Any) -> None:
        assert self.process.stdin is not None
        write_frame(self.process.stdin, message)

    def kill(self) -> None:
        _kill_descendants(self.process.pid)  # what the reward forked, in another session too (worker.py)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def exit_description(self) -> str:
        code = self.process.wait()
        return f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class WorkerPool:
    """``run(units)`` scores units in parallel on ``workers`` processes, in order, never waiting past the
    timeouts. ``restarts`` / ``timeouts`` / ``deaths`` count the run."""

    def __init__(self, spec: str, kwargs: Mapping[str, Any], *, workers: int, timeout_s: float) -> None:
        self.spec, self.kwargs, self.timeout_s = spec, dict(kwargs), timeout_s
        self.restarts = self.timeouts = self.deaths = 0
        self._workers = [self._start() for _ in range(workers)]

    def _start(self) -> _Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in sys.path if p
        )  # the trainer's imports, e.g. a checkout
        process = subprocess.Popen(
            [sys.executable, "-m", "sapo_megatron.rewards.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
            env=env,
        )
        worker = _Worker(process)
        worker.send(("init", self.spec, self.kwargs))
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.restarts += 1
        self._workers[self._workers.index(worker)] = self._start()

    def run(self, units: list[list[RewardInput]]) -> list[list[RewardOutput]]:
        results: list[list[RewardOutput] | None] = [None] * len(units)
        pending = deque(range(len(units)))
        while pending or any(w.task is not None for w in self._workers):
            for worker in self._workers:
                if worker.ready and worker.task is None and pending:
                    worker.task = pending.popleft()
                    worker.deadline = time.monotonic() + self.timeout_s
                    try:
                        worker.send(("task", worker.task, units[worker.task]))
                    except OSError:  # it died while idle
                        self.deaths += 1
                        self._fail(
                            worker, units, results, f"its reward worker died ({worker.exit_description()})"
                        )
            self._wait_once(units, results)
        return [r if r is not None else [] for r in results]

    def _wait_once(self, units: list[list[RewardInput]], results: list) -> None:
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.task is not None]
        deadlines += [w.started + STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
        wait_s = max(0.0, min(deadlines, default=now + 1.0) - now)
        readable, _, _ = select.select([w.fd for w in self._workers], [], [], wait_s)
        for worker in list(self._workers):
            if worker.fd in readable:
                self._receive(worker, units, results)
            elif worker.task is not None and time.monotonic() > worker.deadline:
                self.timeouts += 1
                self._fail(worker, units, results, f"timed out after {self.timeout_s:g} s (worker killed)")
            elif not worker.ready and time.monotonic() > worker.started + STARTUP_TIMEOUT_S:
                raise PoolError(f"reward worker for {self.spec!r} did not start in {STARTUP_TIMEOUT_S:g} s")

    def _receive(self, worker: _Worker, units: list[list[RewardInput]], results: list) -> None:
        message = read_frame(worker.fd)
        if message is None:
            self.deaths += 1
            died = f"its reward worker died ({worker.exit_description()})"
            if not worker.ready:
                worker.kill()
                raise PoolError(f"reward worker for {self.spec!r} died while starting ({died})")
            self._fail(worker, units, results, died)
        elif message[0] == "ready":
            worker.ready = True
        elif message[0] == "init_error":
            worker.kill()
            raise PoolError(f"reward {self.spec!r} does not load in a worker process: {message[1]}")
        else:
            _, task, outputs = message
            results[task] = outputs
            worker.task = None

    def _fail(self, worker: _Worker, units: list[list[RewardInput]], results: list, error: str) -> None:
        if worker.task is not None:
            results[worker.task] = [RewardOutput(0.0, {}, error) for _ in units[worker.task]]
        self._replace(worker)

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers = []


def _kill_descendants(pid: int) -> None:
    try:
        import psutil

        children = psutil.Process(pid).children(recursive=True)
    except Exception:  # psutil missing or the worker already gone: its process group is killed next
        return
    for child in children:
        with contextlib.suppress(Exception):
            child.kill()
