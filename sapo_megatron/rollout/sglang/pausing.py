"""Pausing a fleet's generation for a weight update (SGLang 0.5.23's ``/pause_generation`` and
``/continue_generation``, see :mod:`sapo_megatron.rollout.cpu.pause` for what each mode does on the server).

:class:`PauseState` is what the client knows: whether it paused the fleet, in which mode, and the weight version
before the pause. A sample that a pause in ``abort`` mode cut short is continued after ``continue_generation``
(:mod:`sapo_megatron.rollout.partial`), never restarted. ``in_place`` / ``retract`` keep requests on the server,
which replies with each token's version label (SGLang 0.5.23 ``meta_info.weight_versions``, the CPU server alike,
for every finished request; the client labels its updates with its version numbers); a label that is not one of
this client's numbers since the request was sent is counted (``rollout/partial_unsplit``) and such a sample
carries no versions.
"""

from __future__ import annotations

import threading

from sapo_megatron.rollout.sglang.errors import Cancelled


class PauseState:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.mode: str | None = None
        self.epoch = 0  # pauses begun by this client

    @property
    def paused(self) -> bool:
        return self.mode is not None

    def begin(self, mode: str) -> None:
        with self._cond:
            self.mode = mode
            self.epoch += 1

    def end(self) -> None:
        with self._cond:
            self.mode = None
            self._cond.notify_all()

    def wait_continued(self, cancel: threading.Event, timeout_s: float) -> None:
        """Block until ``continue_generation`` (``Cancelled`` when the call is cancelled, TimeoutError after
        ``timeout_s``)."""
        waited = 0.0
        with self._cond:
            while self.mode is not None:
                if cancel.is_set():
                    raise Cancelled
                if waited >= timeout_s:
                    raise TimeoutError(
                        f"generation stayed paused for {timeout_s:.0f} s (no continue_generation)"
                    )
                self._cond.wait(0.1)
                waited += 0.1
