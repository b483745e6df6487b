"""Pausing the CPU engine's generation like SGLang 0.5.23's ``/pause_generation`` and ``/continue_generation``.

What SGLang does, read in its source (0.5.23):

- ``srt/managers/io_struct.py``: ``PauseGenerationReqInput.mode: Literal["abort", "retract", "in_place"] = "abort"``;
  ``ContinueGenerationReqInput.torch_empty_cache: bool = True`` (a CUDA allocator call; nothing to do on CPU).
- ``srt/entrypoints/http_server.py``: ``POST /pause_generation`` and ``POST /continue_generation``
  (``AuthLevel.ADMIN_OPTIONAL``: with only ``--api-key`` set, the key is required) answer 200
  ``{"message": "Generation paused successfully.", "status": "ok"}`` / ``"Generation continued successfully."``
  once the tokenizer manager returns; a body that fails validation (e.g. an unknown mode) is a
  ``RequestValidationError``, answered 400 by SGLang's handler.
- ``srt/managers/tokenizer_manager.py`` ``pause_generation``: sets ``is_pause`` (new ``/generate`` requests wait in
  ``generate_request`` until ``continue_generation`` clears it). ``abort``: ``abort_request(abort_all=True)`` until no
  request holds the model-update lock - every queued or running request finishes with
  ``FINISH_ABORT`` (``finish_reason {"type": "abort", "message": "Aborted", "status_code": None, ...}``, answered
  200 with the tokens made so far, ``schedule_batch.py``); the scheduler is not paused. ``in_place`` / ``retract``:
  dispatched to the scheduler. ``update_weights_from_*`` skip the model-update writer lock while paused, so weights
  can be updated during a pause.
- ``srt/managers/scheduler.py`` ``pause_generation``: sets ``_engine_paused`` (no forward runs until
  ``continue_generation`` clears it). ``in_place`` leaves the running batch and its KV cache untouched: decoding
  goes on after continue over the cache computed with the old weights. ``retract`` frees the running requests' KV
  (``retract_all``) and puts them back on the waiting queue: after continue their prompt + output so far is
  prefilled again, i.e. with the new weights; tokens already generated are kept, not sampled again.
  ``flush_cache`` works during a retract pause (``is_fully_idle(ignore_waiting=_engine_paused)``), not with running
  requests held in place.

Here a decode loop calls :meth:`PauseGate.checkpoint` between sampling a token and feeding it back (SGLang's
scheduler checks ``_engine_paused`` between forward passes). ``pause`` returns once every running batch has
stopped there (or finished, for ``abort``), as SGLang's reply comes after the scheduler took the pause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Literal, cast

from sapo_megatron.rollout.partial import PAUSE_MODES, PauseMode

Action = Literal["go", "abort", "retract", "in_place"]


@dataclasses.dataclass
class ScriptedPause:
    """A pause at a fixed token count (deterministic tests and benchmarks): when a batch has sampled
    ``after_tokens`` tokens it pauses in ``mode``, runs ``during`` (e.g. a weight update) in the decoding thread, and
    continues."""

    after_tokens: int
    mode: PauseMode
    during: Callable[[], None]


class PauseGate:
    """The pause state of one engine, shared by its decode loops and the server's batcher."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.mode: PauseMode | None = None
        self.abort_epoch = 0  # bumped by each abort pause: requests queued before it are aborted
        self.pauses = 0
        self._decoding = 0  # batches inside a decode loop
        self._parked = 0  # of those, batches waiting at a checkpoint
        self.scripted: list[ScriptedPause] = []

    @property
    def paused(self) -> bool:
        return self.mode is not None

    def pause(self, mode: str, timeout_s: float | None = None) -> None:
        """Pause in ``mode``; return once no batch computes (TimeoutError after ``timeout_s``)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        with self._cond:
            self.mode = mode  # type: ignore[assignment]
            self.pauses += 1
            if mode == "abort":
                self.abort_epoch += 1
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._decoding == self._parked, timeout=timeout_s):
                raise TimeoutError(f"generation did not pause within {timeout_s} s")

    def resume(self) -> None:
        with self._cond:
            self.mode = None
            self._cond.notify_all()

    def _mode_now(self) -> PauseMode | None:
        return self.mode  # read again after a wait (another thread sets it)

    def wait_running(self, timeout_s: float | None) -> bool:
        """Wait up to ``timeout_s`` for generation to be allowed; True when it is."""
        with self._cond:
            return self._cond.wait_for(lambda: self.mode is None, timeout=timeout_s)

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        with self._cond:
            self._decoding += 1
        try:
            yield
        finally:
            with self._cond:
                self._decoding -= 1
                self._cond.notify_all()

    def checkpoint(
        self,
        tokens: int,
        drop_cache: Callable[[], None],
        unlocked: Callable[[], contextlib.AbstractContextManager],
    ) -> Action:
        """Between two decode steps of a batch that has sampled ``tokens`` tokens per row: ``go`` on, ``abort`` the
        live rows, or - after a pause and continue - go on ``in_place`` or ``retract`` (prefill again).

        ``drop_cache`` frees the batch's KV cache (retract); ``unlocked`` releases the engine's locks while parked."""
        for event in [e for e in self.scripted if e.after_tokens == tokens]:
            self.scripted.remove(event)
            if event.mode == "abort":
                return "abort"
            if event.mode == "retract":
                drop_cache()
            event.during()
            return event.mode
        if self.mode is None:
            return "go"
        seen: set[str] = set()
        with self._cond:
            if self.mode == "abort":
                return "abort"
            seen.add(self.mode)
            if self.mode == "retract":
                drop_cache()
            self._parked += 1
            self._cond.notify_all()
        try:
            with unlocked(), self._cond:
                while (mode := self._mode_now()) is not None and mode != "abort":
                    seen.add(mode)
                    self._cond.wait()
                if self._mode_now() == "abort":
                    return "abort"
        finally:
            with self._cond:
                self._parked -= 1
        if "retract" in seen:
            return "retract"
        return "in_place"


class PausableEngine:
    """SGLang's pause, continue and weight-version calls for an engine that holds a :class:`PauseGate` and counts
    its weight updates in ``weight_version`` (the CPU engine)."""

    pause_gate: PauseGate
    weight_version: int

    def pause_generation(self, mode: str = "in_place", timeout_s: float | None = None) -> None:
        """Pause generation like SGLang's ``/pause_generation`` (see this module): ``abort`` finishes running
        rows now, ``in_place`` keeps them and their cache, ``retract`` drops the cache and prefills again with the
        weights of the continue. Weight updates are allowed while paused; returns once no forward runs."""
        self.pause_gate.pause(mode, timeout_s)

    def continue_generation(self) -> None:
        self.pause_gate.resume()

    def served_weight_version(self) -> int:
        return self.weight_version

    def pause_after(self, tokens: int, mode: str, during: Callable[[], None]) -> None:
        """Deterministic pause: the next batch that has sampled ``tokens`` tokens pauses in ``mode``, runs
        ``during`` (e.g. a weight update) and continues (``abort``: its live rows finish, ``during`` is not run)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        self.pause_gate.scripted.append(ScriptedPause(tokens, cast("PauseMode", mode), during))
