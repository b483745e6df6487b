"""Trainer offload and onload: the Megatron DDP parameter and gradient buffers and the optimizer's state leave the
accelerator between training phases, in place, so that every view into them stays valid.

The idea is verl's ``offload_megatron_model_to_cpu`` (``verl/utils/megatron_utils.py``): copy a buffer's data to
(pinned) CPU memory and shrink its storage to zero bytes with ``untyped_storage().resize_(0)``; onload grows the
storage back and copies the data in. Parameters, ``main_grad`` and the distributed optimizer's shards are views into
those storages, so neither Megatron nor the optimizer notices. Differences from verl:

- Everything goes by *storage*, deduplicated: a parameter, its DDP buffer, the FP32 optimizer's parameters (the
  model's own) and the distributed optimizer's shards (views of the buffer) are one storage moved once. This covers
  layouts verl handles case by case (no ``param_data`` without the distributed optimizer; Megatron's shared
  param/grad buffer).
- Gradient storages are dropped without a copy (every step starts with ``zero_grad_buffer``) and zeroed on onload,
  so an onloaded trainer never holds stale gradients.
- The optimizer state covers every wrapped optimizer (``ChainedOptimizer`` too): the inner optimizer's ``state``
  (Adam's moments) and its parameter groups (the FP32 main parameters of mixed precision, the distributed
  optimizer's shards).
- Pinned CPU memory only where an accelerator exists (``pin_memory`` raises on a CPU-only torch). On a CPU-only
  machine the same path runs (copy to a fresh CPU tensor, storage to zero): what the tests check.

``parts`` selects what moves: ``params`` (the weights a weight sync reads), ``grads`` and ``optimizer``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch

PARTS = ("params", "grads", "optimizer")


@dataclasses.dataclass
class _Storage:
    storage: torch.UntypedStorage
    nbytes: int
    keep: bool  # copy the data (False: gradients only, dropped and zeroed)
    saved: torch.Tensor | None = None


class TrainerOffload:
    """Moves one rank's model chunks (Megatron DDP) and optimizer off the accelerator and back.

    ``device``: storages on this device move (default: the first parameter's). On a CPU-only machine that is the
    CPU itself: the copy-and-shrink path runs all the same."""

    def __init__(
        self, model_chunks: Sequence[torch.nn.Module], optimizer, *, device: torch.device | None = None
    ):
        self.model_chunks = list(model_chunks)
        self.optimizer = optimizer
        first = next(p for chunk in self.model_chunks for p in chunk.parameters())
        self.device = device or first.device
        self.pin = torch.cuda.is_available() and self.device.type != "cpu"
        self._parts: dict[str, dict[int, _Storage]] = {}
        for part in PARTS:  # in order: a storage belongs to the first part that reaches it
            self._parts[part] = self._collect(part)
        self.offloaded: set[str] = set()

    def offload(self, parts: Iterable[str] = PARTS) -> int:
        """Copy the chosen parts to CPU and free their accelerator memory; returns the bytes freed."""
        freed = 0
        for part in _check(parts):
            if part in self.offloaded:
                continue
            for entry in self._parts[part].values():
                if entry.keep:
                    entry.saved = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=self.pin)
                    entry.saved.untyped_storage().copy_(entry.storage)
                entry.storage.resize_(0)
                freed += entry.nbytes
            self.offloaded.add(part)
        return freed

    def onload(self, parts: Iterable[str] = PARTS) -> int:
        """Give the chosen parts their memory back, with their data (gradients: zeros); returns the bytes."""
        loaded = 0
        for part in _check(parts):
            if part not in self.offloaded:
                continue
            for entry in self._parts[part].values():
                entry.storage.resize_(entry.nbytes)
                if entry.saved is not None:
                    entry.storage.copy_(entry.saved.untyped_storage(), non_blocking=self.pin)
                    entry.saved = None
                else:
                    torch.empty(0, dtype=torch.uint8, device=self.device).set_(entry.storage).zero_()
                loaded += entry.nbytes
            self.offloaded.discard(part)
        if self.pin:
            torch.cuda.synchronize()  # the pinned copies must land before anything reads the views
        return loaded

    def nbytes(self, parts: Iterable[str] = PARTS) -> int:
        """Bytes the chosen parts occupy on the device when onloaded."""
        return sum(e.nbytes for part in _check(parts) for e in self._parts[part].values())

    # ------------------------------------------------------------------ collection
    def _collect(self, part: str) -> dict[int, _Storage]:
        if part == "params":
            tensors = [(t, True) for t in self._param_tensors()]
        elif part == "grads":
            tensors = [(t, False) for t in self._grad_tensors()]
        else:
            tensors = self._optimizer_tensors()
        found: dict[int, _Storage] = {}
        for tensor, keep in tensors:
            if tensor is None or tensor.device != self.device:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata  # the StorageImpl: one per storage, whatever view reaches it
            if storage.nbytes() == 0 or key in self._claimed(part):
                continue
            entry = found.setdefault(key, _Storage(storage, storage.nbytes(), keep))
            entry.keep |= keep
        return found

    def _claimed(self, part: str) -> set[int]:
        """Storages an earlier part already owns (the FP32 optimizer's parameters are the model's)."""
        earlier = PARTS[: PARTS.index(part)]
        return {key for p in earlier for key in self._parts.get(p, {})}

    def _param_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for chunk in self.model_chunks:
            out.extend(p.data for p in chunk.parameters())
            for buffer in _ddp_buffers(chunk):
                if buffer.param_data is not None:
                    out.append(buffer.param_data)
        return out

    def _grad_tensors(self) -> list[torch.Tensor]:
        out = []
        for chunk in self.model_chunks:
            for buffer in _ddp_buffers(chunk):
                out.append(buffer.grad_data)
            out.extend(g for p in chunk.parameters() if (g := getattr(p, "main_grad", None)) is not None)
        return out

    def _optimizer_tensors(self) -> list[tuple[torch.Tensor, bool]]:
        """(tensor, keep): main parameters and state are kept; the main parameters' ``.grad`` (rewritten from
        ``main_grad`` before every step) is dropped."""
        out: list[tuple[torch.Tensor, bool]] = []
        for inner in _inner_optimizers(self.optimizer):
            for group in inner.param_groups:
                out.extend((p.data, True) for p in group["params"])
                out.extend((p.grad, False) for p in group["params"] if p.grad is not None)
            for state in inner.state.values():
                out.extend((v, True) for v in state.values() if isinstance(v, torch.Tensor))
        return out


def _ddp_buffers(chunk: torch.nn.Module) -> list:
    """Megatron DDP's ``_ParamAndGradBuffer`` lists (instance attributes; ``buffers`` shadows the nn.Module
    method, so read them from ``__dict__``)."""
    return list(chunk.__dict__.get("buffers", [])) + list(chunk.__dict__.get("expert_parallel_buffers", []))


def _inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (``ChainedOptimizer`` holds several)."""
    wrapped = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(w, "optimizer", w) for w in wrapped if getattr(w, "optimizer", w) is not None]


def _check(parts: Iterable[str]) -> list[str]:
    chosen = list(parts)
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown offload part(s) {unknown}; choose from {list(PARTS)}")
    return chosen
