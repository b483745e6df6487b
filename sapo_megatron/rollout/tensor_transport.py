"""Named tensors as SGLang's ``/update_weights_from_tensor`` carries them: one base64 string per TP rank.

Wire format (checked against SGLang ``python/sglang/srt/utils/common.py``, ``MultiprocessingSerializer``):
``base64.b64encode(<ForkingPickler dump of [(name, tensor), ...]>)`` in the standard alphabet, decoded with
``validate=True``. :func:`serialize_named_tensors` produces exactly what ``MultiprocessingSerializer.serialize(named,
output_str=True)`` produces for CPU tensors, and :func:`deserialize_named_tensors` reads either.

ForkingPickler does not copy tensor data: it moves each storage into shared memory and pickles a *handle*, so the
payload stays small and only a process that can open the handle can read the tensors:

- **Same process** (the ``rollout.cpu_http`` mode: ``CPUServer(engine).start()`` inside the trainer): always works.
- **Another local process**, torch's default ``file_descriptor`` strategy: the handle is a file descriptor lent by
  the sender's ``multiprocessing.resource_sharer``, which only processes holding the sender's multiprocessing
  authkey (its ``multiprocessing`` children) may fetch; any other process is refused ("digest sent was rejected")
  and :func:`deserialize_named_tensors` raises :class:`TensorTransportError` saying so. Each handle can be opened
  once.
- **Another local process**, ``torch.multiprocessing.set_sharing_strategy("file_system")`` set by the sender before
  serializing: works (named shared-memory files), as long as the sender keeps the tensors alive until the receiver
  answered.
- **File descriptors**: with ``file_descriptor`` every tensor holds about two descriptors while in flight (one
  after): keep a payload to a few hundred tensors, or raise ``ulimit -n``.
- **Another machine**: never (use ``/update_weights_from_distributed`` or ``/update_weights_from_disk``).
- **CUDA tensors** travel as CUDA IPC handles; SGLang's own serializer additionally patches torch's reductions to
  name devices by UUID (``monkey_patch_torch_reductions``), which this module does not: against a real SGLang on
  GPUs prefer ``sglang.srt.utils.MultiprocessingSerializer``. The CPU server refuses CUDA payloads.

Reading is restricted like SGLang's ``SafeUnpickler`` (CVE-2025-10164), but narrower: only the globals that torch's
CPU tensor reductions emit are resolved; anything else raises :class:`TensorTransportError`.
"""

from __future__ import annotations

import base64
import binascii
import errno
import io
import multiprocessing
import pickle
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler

import torch

from sapo_megatron.errors import UserError

# Globals that a ForkingPickler dump of [(str, CPU tensor or Parameter)] refers to (torch 2.6 - 2.13).
_ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "builtins": frozenset({"list", "tuple", "dict", "str", "int", "float", "bool", "bytes", "slice"}),
    "collections": frozenset({"OrderedDict"}),
    "torch": frozenset({"Tensor", "Size"}),
    "torch.storage": frozenset({"UntypedStorage", "TypedStorage"}),
    "torch.nn.parameter": frozenset({"Parameter"}),
    "torch._utils": frozenset({"_rebuild_tensor_v2", "_rebuild_parameter"}),
    "torch.multiprocessing.reductions": frozenset(
        {
            "rebuild_tensor",
            "rebuild_parameter",
            "rebuild_storage_fd",
            "rebuild_storage_filename",
            "rebuild_storage_empty",
            "rebuild_typed_storage",
            "rebuild_typed_storage_child",
        }
    ),
}
_CUDA_REBUILDERS = {"rebuild_cuda_tensor", "_rebuild_cuda_tensor_modified", "rebuild_event"}


class TensorTransportError(UserError):
    """A ``serialized_named_tensors`` entry that cannot be read here; the message says why and what to use."""


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One ``serialized_named_tensors`` entry: base64 of the ForkingPickler dump of ``named`` (handles, no data).

    Keep the tensors alive until the server has answered: the payload refers to their shared memory.
    """
    for item in named:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError(
                f"serialize_named_tensors expects (name, tensor) pairs, got {type(item).__name__}"
            )
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(list(named))
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_named_tensors(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one entry (base64 text as sent over HTTP, or the raw pickle bytes)."""
    raw = _decode(data) if isinstance(data, str) else data
    try:
        loaded = _RestrictedUnpickler(io.BytesIO(raw)).load()
    except TensorTransportError:
        raise
    except (OSError, RuntimeError) as exc:  # a shared-memory file that cannot be opened
        raise TensorTransportError(_unreachable_message(exc)) from exc
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise TensorTransportError(
            f"serialized_named_tensors is not a tensor payload: {type(exc).__name__}: {exc}"
        ) from exc
    return _check_pairs(loaded)


def _decode(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise TensorTransportError(f"serialized_named_tensors entry is not valid base64: {exc}") from exc


def _check_pairs(loaded: object) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(loaded, (list, tuple)):
        raise TensorTransportError(
            f"serialized_named_tensors must hold a list of (name, tensor) pairs, got {type(loaded).__name__}"
        )
    pairs = []
    for item in loaded:
        if not (
            isinstance(item, (list, tuple))
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise TensorTransportError("serialized_named_tensors must hold (name, tensor) pairs")
        pairs.append((item[0], item[1]))
    return pairs


def _unreachable_message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
        return (
            f"cannot open the shared tensors: {exc}. Each tensor in flight holds file descriptors: send fewer "
            "tensors per request or raise the limit (ulimit -n)"
        )
    return (
        f"cannot open the shared tensors ({type(exc).__name__}: {exc}). Each payload can be read once, while "
        "the sender keeps its tensors; with torch's default 'file_descriptor' sharing strategy only the sending "
        "process and its multiprocessing children can open it: for a server in another local process call "
        "torch.multiprocessing.set_sharing_strategy('file_system') before serializing, and across machines use "
        "update_weights_from_distributed or update_weights_from_disk"
    )


class _SharedFd(resource_sharer.DupFd):
    """``DupFd`` whose fetch from the sender's resource sharer fails with a message that says why."""

    def detach(self) -> int:
        try:
            return super().detach()
        except (multiprocessing.AuthenticationError, OSError, EOFError) as exc:
            raise TensorTransportError(_unreachable_message(exc)) from exc


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if name in _CUDA_REBUILDERS or module.startswith("torch.cuda"):
            raise TensorTransportError(
                "serialized_named_tensors holds CUDA tensors (CUDA IPC handles); this server keeps its model on "
                "CPU: send CPU tensors"
            )
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("multiprocessing.resource_sharer", "DupFd"):
            return _SharedFd
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise TensorTransportError(
            f"serialized_named_tensors refers to {module}.{name}, which is not allowed"
        )
