"""The fully-async producer's hold on the rollout engine (docs/async.md): the chunks in flight share it, a weight
update takes it for itself.

A chunk enters with :meth:`EngineGate.chunk` (it waits while an update is in progress) and leaves when its
generation returns. A weight update either finds no chunk inside (:meth:`try_update`), or announces itself with
:meth:`begin_update` – from then on no chunk enters – and then waits for the chunks inside to leave
(``wait_for_chunks``, ``trainer.pause_mode: none``) or goes ahead beside them while the engine holds them paused
(``/pause_generation`` once for all of them). :meth:`end_update` lets the waiting chunks in. Updates come from one
thread (the trainer's) one at a time; an announced update keeps new chunks out, so chunks cannot starve it. Once its clock is started
(the threaded producer), the gate also counts the time no chunk is inside: the producer's idle time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class EngineGate:
    """Shared by the chunks in flight, exclusive (or pausing them) for a weight update."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._chunks = 0  # chunks generating now
        self._update = False  # an update announced or in progress
        self._clock = False
        self._idle_s = 0.0
        self._idle_since: float | None = None  # the clock runs and no chunk is inside since then

    @property
    def chunks(self) -> int:
        """Chunks inside the gate (generating, or paused by the engine)."""
        with self._cond:
            return self._chunks

    @contextmanager
    def chunk(self) -> Iterator[None]:
        """A chunk's generation: waits while an update is in progress."""
        with self._cond:
            while self._update:
                self._cond.wait()
            self._chunks += 1
            if self._idle_since is not None:
                self._idle_s += time.perf_counter() - self._idle_since
                self._idle_since = None
        try:
            yield
        finally:
            with self._cond:
                self._chunks -= 1
                if self._chunks == 0 and self._clock:
                    self._idle_since = time.perf_counter()
                self._cond.notify_all()

    def start_idle_clock(self) -> None:
        """Count from now the time no chunk is inside."""
        with self._cond:
            self._clock = True
            if self._chunks == 0:
                self._idle_since = time.perf_counter()

    def take_idle_s(self) -> float:
        """Seconds no chunk was inside since the previous call (0 before the clock started)."""
        with self._cond:
            if self._idle_since is not None:
                now = time.perf_counter()
                self._idle_s, self._idle_since = self._idle_s + now - self._idle_since, now
            idle, self._idle_s = self._idle_s, 0.0
            return idle

    def try_update(self) -> bool:
        """Begin an update now if no chunk is inside; False (nothing changed) otherwise."""
        with self._cond:
            if self._chunks or self._update:
                return False
            self._update = True
            return True

    def begin_update(self, *, wait_for_chunks: bool) -> None:
        """Keep new chunks out; with ``wait_for_chunks``, also wait until those inside have left."""
        with self._cond:
            if self._update:
                raise RuntimeError("a weight update is already in progress")
            self._update = True
            while wait_for_chunks and self._chunks:
                self._cond.wait()

    def end_update(self) -> None:
        with self._cond:
            self._update = False
            self._cond.notify_all()
