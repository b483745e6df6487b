"""The colocated step: the rollout engine and the trainer take turns on the same devices (``rollout.colocate``).

Order (slime's ``train.py`` and verl's sharding managers, read in their source):

1. generate (the pipeline, unchanged);
2. release the engine's memory, all tags, after an idle check (``SGLangClient.release_memory``: this client's
   requests done, ``/flush_cache`` accepted by every worker);
3. onload the trainer (parameters, gradients, optimizer state: :class:`~sapo_megatron.megatron.offload.TrainerOffload`);
4. train;
5. offload the gradients and the optimizer state; the parameters stay for the sync;
6. resume the engine's ``weights``;
7. bucketed tensor sync from the trainer's parameters (the weight source: they are on the device already and
   the sync needs them there; a separate CPU copy would cost a second model's worth of host memory per rank);
   optionally hash the buckets as they go and compare with the served weights (``check_weights``);
8. offload the parameters; resume ``kv_cache`` and ``cuda_graph``; flush the cache (verl PR #1464: a stale radix
   cache corrupts the next rollout).

Every phase is timed (``colocate/<phase>_s``) and logged with the memory the trainer holds on its device
(``colocate/trainer_resident_gib``; on a GPU also ``colocate/device_allocated_gib`` from the allocator).

The loop calls :meth:`Colocation.training` once around its updates; the rest happens inside the weight sync
(:class:`ColocatedSync` wraps the configured one), so ``trainer.py`` gains one line.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from sapo_megatron.errors import UserError
from sapo_megatron.megatron.offload import TrainerOffload
from sapo_megatron.rollout.weight_checksum import ChecksumStream, mismatches
from sapo_megatron.weight_sync import WeightSync

GIB = 1024**3
SERVED_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # rollout.precision -> what the server holds


class WeightCheckError(UserError):
    """The served weights differ from the trainer's export after a sync."""


class Colocation:
    """Releases and resumes the engine (main rank) and moves the trainer (every rank) around a step.

    ``engine``: the rollout engine on the main rank (``None`` elsewhere); ``offload``: None keeps the trainer
    resident (the engine is still released); ``on_main``: runs a callable on the main rank only and hands its
    result (or failure) to every rank."""

    def __init__(
        self,
        engine: Any,
        offload: TrainerOffload | None,
        *,
        on_main: Callable[[Callable[[], Any]], Any],
        check_dtype: torch.dtype | None = None,
    ) -> None:
        self.engine = engine
        self.offload = offload
        self.on_main = on_main
        self.check_dtype = check_dtype
        self.released = False
        self.phases: dict[str, float] = {}

    # ------------------------------------------------------------------ the loop's one call
    @contextlib.contextmanager
    def training(self, metrics: dict[str, float]) -> Iterator[None]:
        """Around the step's updates: release the engine and onload the trainer before; offload the gradients
        and the optimizer state after. The step's phase times and memory land in ``metrics`` at the push."""
        self._phase("release", lambda: self.on_main(self.engine_release))
        self.released = True  # on every rank: the control flow of the collectives below must agree
        self._barrier()  # the engine's memory is free on every device before any rank onloads
        if self.offload is not None:
            self._phase("onload", self.offload.onload)
        self._memory("train")
        yield
        offload = self.offload
        if offload is not None:
            self._phase("offload", lambda: offload.offload(["grads", "optimizer"]))
            _return_cached_memory()

    def push(self, inner: WeightSync, module: torch.nn.Module) -> dict[str, float]:
        """Resume the weights, sync through ``inner``, offload the parameters, resume the KV cache, flush."""
        if self.released:
            self._phase(
                "resume_weights", lambda: self.on_main(lambda: self.engine.resume_memory(["weights"]))
            )
        stream = ChecksumStream(self.check_dtype) if self.check_dtype and inner.is_main else None
        if stream is not None:
            inner.on_bucket = stream.add
        try:
            metrics = self._phase("sync", lambda: inner.push(module))
        finally:
            inner.on_bucket = None
        offload = self.offload
        if offload is not None and self.released:
            self._phase("offload_params", lambda: offload.offload(["params"]))
        _return_cached_memory()  # verl PR #6912: the KV cache's resume runs out of memory otherwise
        self._barrier()
        if self.released:
            self._phase("resume_kv", lambda: self.on_main(self.engine_resume_rest))
            self.released = False
        if self.check_dtype is not None:
            self._phase("check", lambda: self.on_main(lambda: self._check(stream)))
        self._memory("rollout")
        out = {**metrics, **self.phases}
        self.phases = {}
        return out

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """The whole trainer on its device for a while (a checkpoint, the final export), then back as it was."""
        offload = self.offload
        away = [] if offload is None else sorted(offload.offloaded)
        if offload is not None and away:
            offload.onload(away)
        try:
            yield
        finally:
            if offload is not None and away:
                offload.offload(away)

    # ------------------------------------------------------------------ pieces (engine calls: main rank)
    def engine_release(self) -> None:
        self.engine.release_memory()  # all tags; refused while busy (idle probe first)

    def engine_resume_rest(self) -> None:
        self.engine.resume_memory(["kv_cache", "cuda_graph"])
        self.engine.flush_cache()

    def _check(self, stream: ChecksumStream | None) -> None:
        if stream is None:
            return
        expected = stream.finish()
        for url, served in self.engine.weight_checksums().items():
            wrong = mismatches(expected, served)
            if wrong:
                raise WeightCheckError(
                    f"after the weight sync {url} serves {len(wrong)} tensor(s) that differ from the trainer's "
                    f"export, first {wrong[0]} (expected {expected.get(wrong[0])}, served {served.get(wrong[0])})"
                )

    def _phase(self, name: str, work: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = work()
        self.phases[f"colocate/{name}_s"] = time.perf_counter() - start
        return result

    def _memory(self, phase: str) -> None:
        if self.offload is not None:
            resident = self.offload.nbytes(
                p for p in ("params", "grads", "optimizer") if p not in self.offload.offloaded
            )
            self.phases[f"colocate/trainer_resident_gib_{phase}"] = resident / GIB
        if torch.cuda.is_available():
            self.phases[f"colocate/device_allocated_gib_{phase}"] = torch.cuda.memory_allocated() / GIB

    @staticmethod
    def _barrier() -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()


def _return_cached_memory() -> None:
    """Hand the allocator's cached blocks back to the device (the engine allocates outside torch's cache) and
    drop the CUDA IPC handles the engine has released (slime: ``ipc_collect`` and ``empty_cache`` after a sync)."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


class ColocatedSync(WeightSync):
    """The configured weight sync, run inside the colocated order (:meth:`Colocation.push`)."""

    def __init__(self, inner: WeightSync, colocation: Colocation) -> None:
        super().__init__(inner.engine, inner.arch)
        self.inner, self.colocation = inner, colocation

    def push(self, module: torch.nn.Module) -> dict[str, float]:
        metrics = self.colocation.push(self.inner, module)
        self.version = self.inner.version
        return metrics

    def _push(self, module: torch.nn.Module) -> int:  # pragma: no cover - push is overridden
        raise AssertionError("ColocatedSync.push drives the inner sync")

    def close(self) -> None:
        self.inner.close()


class NoColocation:
    """A run that does not colocate: the loop's calls do nothing."""

    @contextlib.contextmanager
    def training(self, metrics: dict[str, float]) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        yield
