"""Limits on what a reward may do and return, shared by the inline path, the workers and the remote client
(stdlib only: reward workers import it).

- A score is a finite number (or a bool) with ``|score| <= MAX_ABS_SCORE``; a string, even ``"1.0"``, is refused:
  a reward that returns text has a bug, and ``float("1.0")`` would hide it.
- The extra fields of one sample (logged to ``samples.jsonl``) take at most ``MAX_FIELDS_BYTES`` as JSON; larger
  ones are replaced by a note saying so (a 20 MB field per sample would write 84 MB per step).
- Inline rewards (``reward_workers: 0``) run on the main thread under ``reward_timeout_s`` and stop at the first
  signal of the run (:func:`inline_call`); a call that forks returns in the parent only, and one that calls
  ``sys.exit`` / ``os._exit`` or raises ``KeyboardInterrupt`` is an error of that sample, not the end of the run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

MAX_ABS_SCORE = 1e6
"""The largest score magnitude accepted (rewards are O(1); 1e308 overflows the advantage and loss to inf/nan)."""
MAX_FIELDS_BYTES = 64 << 10
"""The most JSON the extra fields of one sample may take in the logs."""
POLL_S = 0.1
logger = logging.getLogger(__name__)
_WARNED_FIELDS = False
_REAL_EXIT = os._exit


def leave_if_forked(pid: int) -> None:
    """In a child that a reward forked (it returned from the reward in a process that is not ours): exit
    quietly, so that only the process that called the reward goes on."""
    if os.getpid() != pid:
        _REAL_EXIT(0)


class RewardCallStopped(Exception):
    """An inline reward call ran past its timeout (raised inside the call by the timer)."""


class _SignalStop(BaseException):
    """The run's first signal arrived during an inline reward call (a BaseException: the reward's own
    ``except Exception`` and the per-sample error handling let it through)."""


class RewardExit(Exception):
    """The reward tried to end the process (``sys.exit`` / ``os._exit``); raised in its place."""


def check_score(score: float) -> str | None:
    """Why ``score`` is not accepted, or None."""
    if score != score or score in (float("inf"), float("-inf")):
        return f"reward returned a non-finite score {score}; a score is a finite number"
    if abs(score) > MAX_ABS_SCORE:
        return (
            f"reward returned {score:g}, outside the accepted range [-{MAX_ABS_SCORE:g}, {MAX_ABS_SCORE:g}]"
        )
    return None


def bounded_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields``, or a note in their place when their JSON is larger than :data:`MAX_FIELDS_BYTES`."""
    if not fields:
        return fields
    size = len(json.dumps(fields, default=str))
    if size <= MAX_FIELDS_BYTES:
        return fields
    global _WARNED_FIELDS
    if not _WARNED_FIELDS:
        _WARNED_FIELDS = True
        logger.warning(
            "the reward's extra fields take %d bytes of JSON, over the limit of %d: samples.jsonl gets a note in "
            "their place (this warning once)",
            size,
            MAX_FIELDS_BYTES,
        )
    return {"fields_dropped": f"the reward's extra fields took {size} bytes of JSON, over {MAX_FIELDS_BYTES}"}


STOP_SIGNAL = signal.SIGUSR2
"""What the watchdog sends the main thread to stop an inline call: not SIGALRM, which math-verify's own
``signal.alarm`` timeouts use inside the call (a periodic SIGALRM would fire its handler early)."""


class CallClock:
    """The current inline call: its deadline and whether it runs; :meth:`restart` before each call (no system
    call: one watchdog thread serves a whole batch)."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.deadline = float("inf")
        self.active = False  # the watchdog's signal acts only while a reward call runs
        self.reason: str | None = None

    def restart(self) -> None:
        """Before a call (then set ``active`` around it)."""
        self.reason = None
        if self.timeout_s is not None:
            self.deadline = time.monotonic() + self.timeout_s


@contextlib.contextmanager
def inline_call(timeout_s: float | None, stop_requested: Callable[[], bool]) -> Iterator[CallClock]:
    """Run inline reward calls (each after ``clock.restart()``, with ``clock.active`` true) under ``timeout_s`` each and the run's
    signals. On the main thread a watchdog thread checks every :data:`POLL_S`; once a call's time is up it sends
    :data:`STOP_SIGNAL` to the main thread, whose handler raises :class:`RewardCallStopped` inside the call (a
    sleeping reward included); after the run's first SIGTERM / SIGINT it raises ``WaitInterrupted`` there. Also
    turns ``os._exit`` into :class:`RewardExit`. Elsewhere (a rollout thread) only the exit guard applies."""
    clock = CallClock(timeout_s)
    with _no_process_exit():
        if timeout_s is None or threading.current_thread() is not threading.main_thread():
            yield clock
            return

        def stop_call(signum: int, frame: Any) -> None:
            reason, clock.reason = clock.reason, "raised"
            if not clock.active or reason in (None, "raised"):
                return  # between calls, or already raised for this call
            if reason == "signal":
                raise _SignalStop
            raise RewardCallStopped(f"timed out after {timeout_s:g} s (inline, algorithm.reward_timeout_s)")

        done = threading.Event()
        main = threading.get_ident()

        def watch() -> None:
            while not done.wait(POLL_S):
                if not clock.active or clock.reason is not None:
                    continue
                if stop_requested():
                    clock.reason = "signal"
                elif time.monotonic() > clock.deadline:
                    clock.reason = "late"
                else:
                    continue
                signal.pthread_kill(main, STOP_SIGNAL)

        previous = signal.signal(STOP_SIGNAL, stop_call)
        watchdog = threading.Thread(target=watch, name="reward-watchdog", daemon=True)
        watchdog.start()
        try:
            yield clock
        except _SignalStop:
            from sapo_megatron.runtime.interrupts import WaitInterrupted

            raise WaitInterrupted(
                "an inline reward call: interrupted by a signal before it finished"
            ) from None
        finally:
            done.set()
            watchdog.join()
            signal.signal(STOP_SIGNAL, previous)


@contextlib.contextmanager
def _no_process_exit() -> Iterator[None]:
    caller = threading.get_ident()
    pid = os.getpid()

    def refuse(code: int) -> None:
        if threading.get_ident() != caller or os.getpid() != pid:  # another thread (a second signal's exit)
            _REAL_EXIT(code)
        raise RewardExit(f"the reward called os._exit({code})")

    os._exit = refuse  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = _REAL_EXIT
