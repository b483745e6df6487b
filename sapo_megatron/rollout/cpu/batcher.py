"""The CPU server's batchers (the client sends one HTTP request per sample). A request whose client hung up before
it ran is dropped without computing it (:class:`ClientGone`; continuous batching also drops a running one).

- :class:`~sapo_megatron.rollout.cpu.continuous.ContinuousBatcher` (the server's default): SGLang's continuous
  batching, rows join and leave the running batch between decode steps.
- :class:`Batcher` (``--static-batches``): concurrent requests are gathered for a few milliseconds and run through
  the engine as one batch to completion (every request waits for the batch's longest sample). If a batch fails,
  its requests are retried one by one, so that only the failing one gets the error.

While generation is paused (:mod:`.pause`) no new work starts; an ``abort`` pause answers the requests queued
before it at once with ``finish_reason`` abort and no tokens (SGLang aborts its waiting queue), and holds those that
arrive during the pause until ``continue_generation``."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from sapo_megatron.rollout.cpu.decode import RowResult, RowSpec

if TYPE_CHECKING:
    from sapo_megatron.rollout.cpu.engine import CPUEngine

logger = logging.getLogger(__name__)


class QueueBatcher:
    """A thread that serves queued requests (lists of rows) on an engine; subclasses define :meth:`_loop`."""

    def __init__(self, engine: CPUEngine, max_rows: int) -> None:
        self.engine = engine
        self.max_rows = max_rows
        self.dropped = 0  # requests dropped because their client hung up
        self.pending = 0  # requests queued or running (SGLang's "fully idle" is pending == 0)
        self._pending_lock = threading.Lock()
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="cpu-server-batcher", daemon=True)
        self._thread.start()

    def submit(self, rows: list[RowSpec], client_gone: Callable[[], bool] = lambda: False) -> Future:
        future: Future[list] = Future()
        with self._pending_lock:
            self.pending += 1
        future.add_done_callback(self._done)
        self._queue.put(_Item(rows, future, client_gone, self.engine.pause_gate.abort_epoch))
        return future

    def _done(self, _future: Future) -> None:
        with self._pending_lock:
            self.pending -= 1

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        raise NotImplementedError

    def _fail_queued(self) -> None:
        while True:  # fail what is still queued
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item.future.set_exception(RuntimeError("server stopped"))

    def _hold(self, items: list[_Item | None]) -> list[_Item | None]:
        """While paused: abort the items queued before an abort pause, keep the others (and newcomers) for after
        ``continue_generation``. A trailing None means the server stops."""
        gate = self.engine.pause_gate
        while True:
            kept: list[_Item | None] = []
            for item in items:
                if item is not None and item.epoch < gate.abort_epoch:
                    item.future.set_result([_aborted() for _ in item.rows])
                else:
                    kept.append(item)
            items = kept
            if (items and items[-1] is None) or gate.wait_running(0.02):
                return items
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break

    def _screen(self, item: _Item) -> bool:
        """True when ``item`` is to be computed; answers it otherwise (queued before an abort pause: abort; its
        client hung up: :class:`ClientGone`)."""
        if item.epoch < self.engine.pause_gate.abort_epoch:
            item.future.set_result([_aborted() for _ in item.rows])
            return False
        if item.client_gone():  # nobody waits for it: do not compute it
            item.future.set_exception(ClientGone("the client closed its connection"))
            self.dropped += 1
            return False
        return True

    def _run_alone(self, item: _Item) -> None:
        """Run one request as its own static batch, answering its result or error."""
        try:
            results = self.engine.generate_rows(item.rows)
        except Exception as exc:
            logger.exception("generation failed")  # handed to the waiting request, which answers 500
            item.future.set_exception(exc)
            return
        item.future.set_result(results)


class Batcher(QueueBatcher):
    """Runs queued rows through the engine in static batches, gathering arrivals for ``window_s``."""

    def __init__(self, engine: Any, window_s: float, max_rows: int) -> None:
        self.window_s = window_s
        super().__init__(engine, max_rows)

    def _loop(self) -> None:
        held: list[_Item | None] = []
        while True:
            item = held.pop(0) if held else self._queue.get()
            if item is None:
                for stale in held:
                    if stale is not None:
                        stale.future.set_exception(RuntimeError("server stopped"))
                break
            if self.engine.pause_gate.paused:
                held = self._hold([item, *held])  # a trailing None (stop) is popped last, above
                continue
            items = [item]
            deadline = time.monotonic() + self.window_s
            stopping = False
            while sum(len(it.rows) for it in items) < self.max_rows:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    nxt = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
                if nxt is None:
                    stopping = True
                    break
                items.append(nxt)
            self._run(items)
            if stopping:
                break
        self._fail_queued()

    def _run(self, items: list[_Item]) -> None:
        live = [item for item in items if self._screen(item)]
        if len(live) == 1:
            self._run_alone(live[0])
            return
        if not live:
            return
        try:
            results = self.engine.generate_rows([row for it in live for row in it.rows])
        except Exception as exc:  # find the request that failed; the others get their results
            logger.warning("a batch of %d requests failed (%s); running them one by one", len(live), exc)
            for item in live:
                self._run_alone(item)
            return
        offset = 0
        for item in live:
            item.future.set_result(results[offset : offset + len(item.rows)])
            offset += len(item.rows)


@dataclasses.dataclass
class _Item:
    rows: list[RowSpec]
    future: Future
    client_gone: Callable[[], bool]
    epoch: int  # the engine's abort epoch when it arrived


def _aborted() -> RowResult:
    return RowResult(
        output_ids=[],
        output_logprobs=[],
        finish_reason="abort",
        matched_stop=None,
        input_logprobs=None,
        routed_experts=None,
    )


class ClientGone(RuntimeError):
    """The client of a queued request hung up; its rows are not computed and nothing is answered."""
