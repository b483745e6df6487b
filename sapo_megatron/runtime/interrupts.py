"""Stop a run cleanly on a signal: the first SIGINT / SIGTERM / SIGUSR1 asks the loop to stop after the current
step (it then writes a checkpoint and exits); a second one exits at once.

How it works, and why:

- Signals are noticed by a watcher thread through :func:`signal.set_wakeup_fd` (the interpreter's C-level handler
  writes each signal's number to a pipe the moment it arrives). The Python-level handlers do nothing but keep
  the default actions (``KeyboardInterrupt``, termination) away. A Python handler runs only between bytecodes
  of the main thread, i.e. not while it waits in a long C call (a collective, a GPU sync); the watcher runs
  regardless, so arrival times are exact and the second signal exits even then.
- One interruption often arrives twice: a terminal's Ctrl-C and the same signal forwarded by a launcher, or
  SLURM signalling every process of a job step while ``torchrun`` forwards it to its workers. Signals within
  ``repeat_window_s`` of the first count as that one request; only a later one means "exit now".
- "Exit now" prints one line, flushes stdout/stderr, SIGKILLs this process's own child processes (which would
  otherwise outlive it and hold its output pipes open) and leaves through ``os._exit`` with code 130, so that
  no thread, child or unfinished collective can hold the exit up.
- :meth:`InterruptGuard.should_stop` combines the flags of all ranks (MAX all-reduce): ranks receive signals at
  different times, and every rank must stop after the same step to write one checkpoint together.

SLURM's pre-timeout signal (``#SBATCH --signal=USR1@120``) is SIGUSR1, hence the default set.

Network waits that can last long (weight sync: HTTP replies, broadcasts) wait through :func:`wait_for` or poll
:func:`stop_requested`: once the first signal arrived they raise :class:`WaitInterrupted` within ``poll_s``, so
the loop reaches its checkpoint in seconds instead of after the wait's timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, wait
from types import FrameType, TracebackType
from typing import Any

from sapo_megatron.errors import UserError

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
EXIT_NOW_CODE = 130
"""Exit status after a second signal (and of an interrupted run: ``errors.RunInterrupted.exit_code``)."""


_STOP_REQUESTED = threading.Event()  # set by an active guard's first signal, cleared when it exits


class WaitInterrupted(UserError):
    """A network wait gave up because a signal asked the run to stop (nothing is lost: it resumes)."""

    exit_code = EXIT_NOW_CODE


def stop_requested() -> bool:
    """Whether an active :class:`InterruptGuard` of this process received its first signal."""
    return _STOP_REQUESTED.is_set()


def wait_for(futures: Sequence[Future], what: str, poll_s: float = 0.1) -> None:
    """Wait until every future is done, or raise :class:`WaitInterrupted` soon after a signal (the futures keep
    running; their own timeouts bound them)."""
    pending = set(futures)
    while pending:
        if _STOP_REQUESTED.is_set():
            raise WaitInterrupted(f"{what}: interrupted by a signal before it finished")
        _, pending = wait(pending, timeout=poll_s)


def print_line(text: str) -> None:
    """Write one line to stderr without breaking a progress bar that is being drawn, in one write(2): stderr is
    unbuffered, and ``tqdm.write(text)`` writes the text and its newline separately, so a line that another
    thread writes to the same pipe in between (a rank's step line) ended up glued to this one."""
    try:
        from tqdm import tqdm

        tqdm.write(text + "\n", file=sys.stderr, end="")
    except Exception:  # the line must get out even if tqdm cannot write
        os.write(2, (text + "\n").encode())


class InterruptGuard:
    """Context manager: while active, ``signals`` request a graceful stop instead of killing the process.

    ``announce`` prints the one-line messages (pass ``None`` on all but the main rank). Must be entered in the
    main thread; restores the previous handlers and wakeup fd on exit. Typical use::

        with InterruptGuard(announce=print_line if is_main else None) as guard:
            while step < steps:
                train_one_step()
                if guard.should_stop():  # collective: every rank calls it after every step
                    save_checkpoint()
                    raise RunInterrupted(f"interrupted at step {step} ({guard.reason})")
    """

    def __init__(
        self,
        signals: Iterable[int | str] = DEFAULT_SIGNALS,
        *,
        announce: Callable[[str], None] | None = print_line,
        repeat_window_s: float = 1.0,
        exit_code: int = EXIT_NOW_CODE,
        exit_until_started: bool = False,
    ) -> None:
        self.signals = tuple(_as_signal(sig) for sig in signals)
        self._started = not exit_until_started
        self.announce = announce
        self.repeat_window_s = repeat_window_s
        self.exit_code = exit_code
        self._first: tuple[signal.Signals, float] | None = None
        self._peer_requested = False
        self._lock = threading.Lock()
        self._previous_handlers: dict[signal.Signals, Any] = {}
        self._previous_wakeup_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None

    # -- state -----------------------------------------------------------------------------------------

    @property
    def requested(self) -> bool:
        """A signal asked this process to stop (this rank only; see :meth:`should_stop`)."""
        return self._first is not None

    @property
    def signal_name(self) -> str | None:
        """Name of the first signal this process received (``"SIGINT"``), or ``None``."""
        return None if self._first is None else self._first[0].name

    @property
    def reason(self) -> str:
        """Why the run stops, for messages: ``"SIGTERM"``, ``"a signal to another rank"`` or ``"no signal"``."""
        if self._first is not None:
            return self._first[0].name
        return "a signal to another rank" if self._peer_requested else "no signal"

    def should_stop(self, all_reduce: bool = True, group: Any = None) -> bool:
        """Whether the loop should stop after this step.

        With ``all_reduce`` and an initialized process group of more than one rank this is a collective (a MAX
        all-reduce of one int over ``group``, default: the world): every rank must call it at the same point,
        and all get the same answer. Without a process group it is the local flag.
        """
        local = self.requested
        if not all_reduce:
            return local
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return local
        flag = torch.tensor([int(local)], dtype=torch.int32, device=_collective_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        stop = bool(flag.item())
        if stop and not local:
            self._peer_requested = True
        return stop

    def started(self) -> None:
        """The run has begun its steps: from now on the first signal asks for a checkpoint. Before this call
        (with ``exit_until_started``) there is nothing to save, so the first signal exits at once instead of
        waiting for a start-up that may never end (a dead router, a hung server)."""
        self._started = True

    # -- installation ----------------------------------------------------------------------------------

    def __enter__(self) -> InterruptGuard:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "InterruptGuard must be entered in the main thread (signal handlers live there)"
            )
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C-level handler must never block
        self._pipe = (read_fd, write_fd)
        self._watcher = threading.Thread(
            target=self._watch, args=(read_fd,), name="interrupt-guard", daemon=True
        )
        self._watcher.start()
        for sig in self.signals:
            self._previous_handlers[sig] = signal.signal(sig, _ignore_in_python)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._first is not None:  # absorb a duplicate of the request still on its way (see the docstring)
            time.sleep(max(self._first[1] + self.repeat_window_s - time.monotonic(), 0.0))
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()
        _STOP_REQUESTED.clear()
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        if self._pipe is not None:
            read_fd, write_fd = self._pipe
            os.close(write_fd)  # the watcher reads EOF and ends
            if self._watcher is not None:
                self._watcher.join(timeout=5)
            os.close(read_fd)
            self._pipe = None

    # -- the watcher thread ----------------------------------------------------------------------------

    def _watch(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 512)
            except OSError:
                return
            if not data:
                return
            arrived = time.monotonic()
            for number in data:  # one byte per signal delivered
                if number in self.signals:
                    self._on_signal(signal.Signals(number), arrived)

    def _on_signal(self, sig: signal.Signals, arrived: float) -> None:
        with self._lock:
            first = self._first
            if first is None:
                self._first = (sig, arrived)
        if first is None and not self._started:
            self._say(f"sapo-megatron: {sig.name} during start-up: nothing to save yet, exiting now")
            exit_now(self.exit_code)
        if first is None:
            _STOP_REQUESTED.set()
            self._say(
                f"sapo-megatron: {sig.name}: stopping after the current step; signal again to exit at once"
            )
        elif arrived - first[1] > self.repeat_window_s:
            self._say(f"sapo-megatron: {sig.name} again: exiting now, without a checkpoint")
            exit_now(self.exit_code)
        # else: the first request delivered a second time (terminal + launcher, SLURM + torchrun)

    def _say(self, text: str) -> None:
        if self.announce is not None:
            with contextlib.suppress(Exception):
                self.announce(text)


def exit_now(code: int = EXIT_NOW_CODE) -> None:
    """Leave the process at once: flush stdout/stderr, SIGKILL own child processes, ``os._exit(code)``."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    kill_child_processes()
    os._exit(code)


def kill_child_processes() -> None:
    """SIGKILL every descendant of this process (helper processes that would outlive it)."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:  # best effort on the way out
        return
    for child in children:
        with contextlib.suppress(Exception):
            child.kill()


def _ignore_in_python(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: the watcher thread acts on the signal (see the module docstring)."""


def _as_signal(sig: int | str) -> signal.Signals:
    if isinstance(sig, str):
        name = sig.upper() if sig.upper().startswith("SIG") else f"SIG{sig.upper()}"
        return signal.Signals[name]
    return signal.Signals(sig)


def _collective_device(group: Any) -> Any:
    """The device an all-reduce over ``group`` needs: CUDA for NCCL, CPU for gloo."""
    import torch
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
