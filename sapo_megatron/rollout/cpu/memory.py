"""The CPU server's memory endpoints, as SGLang 0.5.23 answers them (colocation; see :mod:`sapo_megatron.rollout.sglang.memory` for
what SGLang does and where it is in its source).

- ``POST|GET /release_memory_occupation`` / ``/resume_memory_occupation`` with ``{"tags": [...]}`` (``null`` or
  ``[]``: all of ``kv_cache``, ``weights``, ``cuda_graph``): 200 with the body ``null``.
- What SGLang's scheduler dies of brings this server down too (it stops and answers nothing, as a crashed SGLang
  server): a release while a request runs or waits (``assert is_fully_idle``), a resume of a tag that is not
  released (``KeyError``). Unknown tags are kept as SGLang keeps them (a set of strings).
- ``memory_saver`` (``--enable-memory-saver``) decides what a release does to the weights: without it, nothing
  (SGLang's no-op adapter; what real SGLang on CPU does); with it, released weights come back as garbage on
  resume (fresh pages from torch_memory_saver), unless ``weights_cpu_backup`` (``--enable-weights-cpu-backup``)
  restores a copy taken at release. Generation while weights or the KV cache are released under the memory saver
  reads unmapped memory on a GPU; this server dies of it instead.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import torch

from sapo_megatron.rollout.cpu.engine import CPUEngine
from sapo_megatron.rollout.cpu.weights import InvalidRequest
from sapo_megatron.rollout.weight_checksum import expected_checksums

logger = logging.getLogger(__name__)

ALL_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES
_PLACEMENT = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0}
_PLACEMENT |= {"pp_size": 1, "rank": 0, "size": 1}
_GARBAGE_SEED = 6367  # sglang #6367: random output after a resume without the weights re-sent


class SchedulerCrash(RuntimeError):
    """What takes a real SGLang server down; the server stops and the request gets no reply."""


class MemoryEndpoints:
    """Release and resume on one :class:`CPUEngine`. ``busy`` says whether requests run or wait; ``crash`` brings
    the server down (at once: the request that triggers it must get no reply)."""

    def __init__(
        self,
        engine: CPUEngine,
        *,
        busy: Callable[[], bool],
        crash: Callable[[], None],
        memory_saver: bool = False,
        weights_cpu_backup: bool = False,
    ) -> None:
        self.engine = engine
        self.memory_saver = memory_saver
        self.weights_cpu_backup = weights_cpu_backup
        self.released: set[str] = set()
        self._busy = busy
        self._crash = crash
        self._backup: dict[str, torch.Tensor] | None = None

    def release(self, body: dict[str, Any], request: Any = None) -> tuple[HTTPStatus, None]:
        tags = _tags(body)
        if self._busy():
            self._die("AssertionError: release_memory_occupation should be called only when server is idle.")
        self.released.update(tags)
        if "weights" in tags and self.memory_saver and self.weights_cpu_backup:
            self._backup = {n: p.detach().clone() for n, p in self.engine.model.named_parameters()}
        return HTTPStatus.OK, None

    def resume(self, body: dict[str, Any], request: Any = None) -> tuple[HTTPStatus, None]:
        tags = _tags(body)
        for tag in tags:
            if tag not in self.released:
                self._die(f"KeyError: {tag!r}")
            self.released.remove(tag)
        if "weights" in tags and self.memory_saver:
            self._refill_weights()
        return HTTPStatus.OK, None

    def check_serving(self) -> None:
        """Called before generation: under the memory saver, released weights or KV cache are unmapped."""
        gone = self.released & {"weights", "kv_cache"}
        if gone and self.memory_saver:
            self._die(f"generation with {sorted(gone)} released (memory unmapped by the memory saver)")

    def check_weights(self, body: dict[str, Any], request: Any = None) -> tuple[HTTPStatus, dict[str, Any]]:
        """SGLang's ``/weights_checker`` for ``action: checksum`` (the served names and hashes of a TP-1 SGLang
        server); its other actions (snapshot / reset_tensors / compare) are not implemented here: 400."""
        action = body.get("action", "checksum")
        if action != "checksum":
            return HTTPStatus.BAD_REQUEST, {
                "success": False,
                "message": f"Unsupported {action=} (CPU stand-in)",
            }
        with torch.no_grad():
            named = [(n, p.detach()) for n, p in self.engine.model.named_parameters()]
            checksums = expected_checksums(named)
        overall = hashlib.sha256()  # SGLang's overall_checksum
        for name in sorted(checksums):
            overall.update(name.encode())
            overall.update(checksums[name].encode())
        rank = {
            "checksums": checksums,
            "per_gpu_checksum": overall.hexdigest(),
            "parallelism_info": [_PLACEMENT],
        }
        return HTTPStatus.OK, {"success": True, "message": "Success.", "ranks": [rank]}

    def _refill_weights(self) -> None:
        params = dict(self.engine.model.named_parameters())
        with torch.no_grad():
            if self._backup is not None:
                for name, saved in self._backup.items():
                    params[name].copy_(saved)
                self._backup = None
                return
            generator = torch.Generator().manual_seed(_GARBAGE_SEED)
            for param in params.values():
                param.copy_(torch.rand(param.shape, generator=generator).to(param.dtype))

    def _die(self, reason: str) -> None:
        logger.error("Scheduler hit an exception: %s (the server goes down, as SGLang's does)", reason)
        self._crash()
        raise SchedulerCrash(reason)


def _tags(body: dict[str, Any]) -> list[str]:
    tags = body.get("tags")
    if tags is None or tags == []:
        return list(ALL_TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise InvalidRequest("tags: Input should be a valid list of strings")
    return tags
