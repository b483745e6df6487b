"""Memory release and resume of SGLang servers (colocation): the tags, and the state machine that keeps a client
from sending a call that would take a server down.

What SGLang 0.5.23 does (read in ``srt/managers/scheduler_components/weight_updater.py``,
``release_memory_occupation`` / ``resume_memory_occupation``, and ``srt/entrypoints/http_server.py``):

- ``POST /release_memory_occupation`` and ``/resume_memory_occupation`` take ``{"tags": [...]}`` from
  :data:`MEMORY_TAGS` (``srt/constants.py``: ``GPU_MEMORY_ALL_TYPES``); ``null`` or ``[]`` means all three. Both
  answer 200 with the body ``null``.
- Release starts with ``assert self.is_fully_idle(...)``; the scheduler keeps the released tags in a set
  (``offload_tags.add``), and resume removes them (``offload_tags.remove``): resuming a tag that is not released
  raises ``KeyError``. Neither is caught in the scheduler: its exception handler logs "Scheduler hit an exception"
  and sends SIGQUIT to the server, so the whole server goes down (inferred from reading the code, not
  triggered: a test that kills a real server costs a 2-minute restart).
- Releasing ``weights`` twice would stash the model's static state from memory that the memory saver has already
  unmapped; SGLang does not guard it either, so this client refuses a second release of a tag as well.
- Without ``--enable-memory-saver`` both calls are pure control flow (the adapter is a no-op): the weights stay
  valid. With it, released weights come back as garbage unless the server runs with
  ``--enable-weights-cpu-backup`` (sglang #6367); a colocated run therefore re-sends the weights after each
  resume (slime's order).

:class:`MemoryState` mirrors the scheduler's set per server and refuses, before anything is sent: a release while
requests run, a release of a tag already released, a resume of a tag not released, and generation or weight
loading while what they need is released.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from sapo_megatron.rollout.base import RolloutError

# SGLang's GPU_MEMORY_ALL_TYPES, in its order (srt/constants.py)
MEMORY_TAGS: tuple[str, ...] = ("kv_cache", "weights", "cuda_graph")


class MemoryStateError(RolloutError):
    """A memory call that the server's scheduler would die of; refused before it is sent."""


def normalize_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """The tags a call acts on, as SGLang reads them: None or empty means all of :data:`MEMORY_TAGS`."""
    given = tuple(tags or ())
    unknown = [t for t in given if t not in MEMORY_TAGS]
    if unknown:
        raise MemoryStateError(
            f"unknown memory tag(s) {unknown}; SGLang knows {list(MEMORY_TAGS)} (an empty list means all)",
            field="tags",
        )
    if len(set(given)) != len(given):
        raise MemoryStateError(f"memory tags {list(given)} name a tag twice", field="tags")
    return given or MEMORY_TAGS


@dataclasses.dataclass
class MemoryState:
    """The tags one server holds released, as its scheduler's ``offload_tags``."""

    server: str
    released: set[str] = dataclasses.field(default_factory=set)

    def check_release(self, tags: tuple[str, ...], busy: int) -> None:
        """Refuse what SGLang's release would die of: requests still running, or a tag already released."""
        if busy:
            raise MemoryStateError(
                f"release_memory_occupation({list(tags)}) while {busy} request(s) run: SGLang asserts that the "
                "server is idle and goes down otherwise; wait for generation (and scoring) to finish first",
                server=self.server,
                field="tags",
            )
        again = [t for t in tags if t in self.released]
        if again:
            raise MemoryStateError(
                f"memory {again} is already released; resume it before releasing it again",
                server=self.server,
                field="tags",
            )

    def check_resume(self, tags: tuple[str, ...]) -> None:
        """Refuse a resume of a tag that is not released (SGLang's scheduler raises ``KeyError`` and dies)."""
        missing = [t for t in tags if t not in self.released]
        if missing:
            held = sorted(self.released) or "nothing"
            raise MemoryStateError(
                f"resume_memory_occupation({list(tags)}): {missing} is not released (released: {held}); "
                "SGLang's scheduler raises KeyError and the server goes down",
                server=self.server,
                field="tags",
            )

    def require(self, tags: Iterable[str], what: str) -> None:
        """Refuse ``what`` while any of ``tags`` is released (the memory it needs is gone)."""
        missing = [t for t in tags if t in self.released]
        if missing:
            raise MemoryStateError(
                f"{what} needs memory {missing}, which is released; resume_memory({missing}) first",
                server=self.server,
                field="tags",
            )
