"""Continuous batching for the CPU server, with SGLang's scheduler semantics.

What SGLang 0.5.23 does (``srt/managers/scheduler.py``, read in its source): every scheduler iteration
(``get_next_batch_to_run``) merges the last prefill batch into the running decode batch (``merge_batch``), drops
the running requests that finished (``filter_batch``), and then runs a prefill of waiting requests if any fit
(``get_new_batch_prefill``, up to ``max_running_requests``; "run prefill first if possible") or else one decode
step of the running batch (``update_running_batch``). A request is answered (``stream_output``) as soon as it
finishes, not when its batch does; a request arriving while others decode joins them at the next iteration.

Here, between two decode steps of the running batch (:class:`~sapo_megatron.rollout.cpu.decode.Running`):

1. queued requests (whole requests, first come first served, while the running rows stay within ``max_rows``;
   one request of more rows than that runs when the batch is empty) are prefilled as their own batch and merged
   into the running one (masks and KV caches left padded to a common width; positions are per row);
2. every row samples its next token (a joined row its first one, from its own prefill);
3. rows that finished leave the batch (index-select on the batch dim of cache, mask, positions), and a request is
   answered as soon as all its rows (its ``n`` samples) are done;
4. the pause check (:meth:`~sapo_megatron.rollout.cpu.pause.PauseGate.checkpoint`): ``in_place`` keeps the
   batch, ``retract`` prefills its rows again after the continue, ``abort`` answers every running row with
   ``finish_reason`` abort and its tokens so far. No request joins while generation is paused; requests that
   arrive during a pause are held until ``continue_generation`` (those queued before an abort pause are aborted);
5. the live rows' tokens are fed (one forward).

A row's tokens, log-probs, per-token weight versions and routes (route capture is per forward; a joined row's
come from its own prefill and feeds) equal those of the row run alone up to float noise: each row samples from
its own seeded generator. Rows without ``sampling_seed`` get a seed from the engine's seed when they join.

The engine's locks are taken per step, so a weight update sent without a pause lands between two decode steps
(its tokens after it report the new version, as ``in_place``); SGLang's update waits for running requests
instead (its ``model_update_lock``). The project's pipelines pause, or wait for the requests in flight, before an
update, so they see the same on both.

A failure (a forward raising) fails the merged batch: a request alone in it gets the error; otherwise each of its
unanswered requests is run again alone from its prompt as a static batch (:meth:`CPUEngine.generate_rows`, same
seeds), so that only the failing one gets the error, as the static batcher retries. A request whose client hung
up is dropped (:class:`~sapo_megatron.rollout.cpu.batcher.ClientGone`) when it would join, and while it runs
(checked every ``GONE_CHECK_STEPS`` steps), as SGLang aborts the request of a closed connection.
VL rows join like text rows (their MRoPE positions are per row too). Stopping the server fails running and queued
requests with "server stopped".
"""

from __future__ import annotations

import dataclasses
import logging
import queue
from contextlib import ExitStack
from typing import TYPE_CHECKING

import torch

from sapo_megatron.rollout.cpu.batcher import ClientGone, QueueBatcher, _Item
from sapo_megatron.rollout.cpu.decode import Decoder, Running, _Row, abort_live
from sapo_megatron.rollout.cpu.engine import _COMPUTE_LOCK, _torch_threads

if TYPE_CHECKING:
    from sapo_megatron.rollout.cpu.engine import CPUEngine

logger = logging.getLogger(__name__)

GONE_CHECK_STEPS = 8  # decode steps between two checks for running requests whose client hung up


@dataclasses.dataclass
class _Slot:
    """A request being served: its rows' results as they finish."""

    item: _Item
    results: list
    left: int


class ContinuousBatcher(QueueBatcher):
    """Serves queued requests with continuous batching (see the module)."""

    def __init__(self, engine: CPUEngine, max_rows: int) -> None:
        self.decoder = Decoder(engine, engine._unlocked)
        self._waiting: list[_Item] = []
        self._stopping = False
        self._slots: dict[int, tuple[_Slot, int]] = {}  # id(row) -> its request and index
        self._steps = 0
        super().__init__(engine, max_rows)

    # ------------------------------------------------------------------ the queue
    def _loop(self) -> None:
        with _torch_threads(self.engine.num_threads):
            while not self._stopping:
                if not self._waiting:
                    self._take(block=True)
                self._take(block=False)
                if self._stopping:
                    break
                if self.engine.pause_gate.paused:
                    held = self._hold(list(self._waiting))
                    self._stopping = bool(held) and held[-1] is None
                    self._waiting = [it for it in held if it is not None]
                    continue
                self._serve()
        for item in self._waiting:
            item.future.set_exception(RuntimeError("server stopped"))
        self._fail_queued()

    def _take(self, *, block: bool) -> None:
        """Move arrivals from the queue to ``_waiting`` (one, waiting for it, or all there are)."""
        while not self._stopping:
            try:
                item = self._queue.get() if block else self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._stopping = True
            else:
                self._waiting.append(item)
            if block:
                return

    # ------------------------------------------------------------------ the running batch
    def _serve(self) -> None:
        """Run the running batch until it is empty (or the server stops, or a forward fails)."""
        gate = self.engine.pause_gate
        try:
            with torch.no_grad(), gate.decoding():
                run: Running | None = None
                while True:
                    run = self._iteration(run)
                    if run is None or self._stopping:
                        break
        except Exception as exc:
            self._recover(exc)
            return
        finally:
            if self.engine._routers is not None:
                self.engine._routers.enabled = False
        if self._stopping:
            self._fail_running(RuntimeError("server stopped"))

    def _iteration(self, run: Running | None) -> Running | None:
        """Join, sample, answer, pause check, feed: one decode step; the batch after it (None when empty)."""
        decoder = self.decoder
        with ExitStack() as locks:
            locks.enter_context(self.engine._lock)
            locks.enter_context(_COMPUTE_LOCK)
            run = self._join(run)
            if run is None:
                return None
            tokens = decoder.sample(run)
            keep = self._drop_gone(run, self._answer_finished(run))
            if not keep:
                return None
            decoder.select(run, keep)
            action = decoder.checkpoint(run)
            if action == "abort":
                abort_live(run.rows)
                self._answer_finished(run)
                return None
            if action == "retract":
                return decoder.prefill(run.rows, first=False)
            decoder.feed(run, tokens[torch.tensor(keep, dtype=torch.long)])
            return run

    def _join(self, run: Running | None) -> Running | None:
        """Prefill the waiting requests that fit and merge them into ``run`` (none while paused)."""
        self._take(block=False)
        if self.engine.pause_gate.paused or self._stopping:
            return run
        rows: list[_Row] = []
        room = self.max_rows - (len(run.rows) if run is not None else 0)
        while self._waiting:
            item = self._waiting[0]
            if len(item.rows) > room - len(rows) and (run is not None or rows):
                break
            self._waiting.pop(0)
            if self.engine._closed:
                item.future.set_exception(RuntimeError("CPUEngine is closed"))
            elif self._screen(item):
                rows.extend(self._admit(item))
        if not rows:
            return run
        joined = self.decoder.prefill(rows, first=True)
        if run is None:
            return joined
        self.decoder.merge(run, joined)
        return run

    def _admit(self, item: _Item) -> list[_Row]:
        seeds = []
        for spec in item.rows:  # kept, so that a retry alone samples the same tokens
            if spec.seed is None:
                spec.seed = int(self.engine._seed_rng.integers(2**62))
            seeds.append(spec.seed)
        rows = self.decoder.new_rows(item.rows, seeds)
        slot = _Slot(item, [None] * len(rows), len(rows))
        for index, row in enumerate(rows):
            self._slots[id(row)] = (slot, index)
        return rows

    def _answer_finished(self, run: Running) -> list[int]:
        """Answer the rows of ``run`` that are done (a request once all its rows are); the others' indices."""
        keep = []
        for i, row in enumerate(run.rows):
            if not row.done:
                keep.append(i)
                continue
            slot, index = self._slots.pop(id(row))
            slot.results[index] = self.decoder.result(row)
            slot.left -= 1
            counters = self.engine._counters
            counters["rollout/samples"] += 1
            counters["rollout/generated_tokens"] += len(row.outputs)
            if slot.left == 0:
                slot.item.future.set_result(slot.results)
        return keep

    def _drop_gone(self, run: Running, keep: list[int]) -> list[int]:
        """Every ``GONE_CHECK_STEPS`` steps: drop the running requests whose client hung up; the rows kept."""
        self._steps += 1
        if self._steps % GONE_CHECK_STEPS:
            return keep
        gone: set[int] = set()
        for i in keep:
            slot, _ = self._slots[id(run.rows[i])]
            if id(slot.item) not in gone and slot.item.client_gone():
                gone.add(id(slot.item))
                slot.item.future.set_exception(ClientGone("the client closed its connection"))
                self.dropped += 1
        if not gone:
            return keep
        kept = []
        for i in keep:
            if id(self._slots[id(run.rows[i])][0].item) in gone:
                del self._slots[id(run.rows[i])]
            else:
                kept.append(i)
        return kept

    # ------------------------------------------------------------------ failures
    def _live_items(self) -> list[_Item]:
        items: list[_Item] = []
        for slot, _ in self._slots.values():
            if slot.item not in items:
                items.append(slot.item)
        self._slots.clear()
        return items

    def _recover(self, exc: Exception) -> None:
        """A forward failed: a request alone gets the error, several are run again one by one."""
        items = self._live_items()
        if len(items) == 1:
            logger.exception("generation failed")  # handed to the waiting request, which answers 500
            items[0].future.set_exception(exc)
            return
        logger.warning("a batch of %d requests failed (%s); running them one by one", len(items), exc)
        for item in items:
            self._run_alone(item)

    def _fail_running(self, exc: Exception) -> None:
        for item in self._live_items():
            item.future.set_exception(exc)
