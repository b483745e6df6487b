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
  serializing (``serialize_named_tensors(named, sharing="file_system")`` does it for one dump): works (named shared-memory files), as long as the sender keeps the tensors alive until the receiver
  answered.
- **File descriptors**: with ``file_descriptor`` every tensor holds about two descriptors while in flight (one
  after): keep a payload to a few hundred tensors, or raise ``ulimit -n``.
- **Another machine**: never (use ``/update_weights_from_distributed`` or ``/update_weights_from_disk``).
- **CUDA tensors** travel as CUDA IPC handles; SGLang's own serializer additionally patches torch's reductions to
  name devices by UUID (``monkey_patch_torch_reductions``), which this module does not: against a real SGLang on
  GPUs prefer ``sglang.srt.utils.MultiprocessingSerializer``. The CPU server refuses CUDA payloads.

Reading is restricted like SGLang's ``SafeUnpickler`` (CVE-2025-10164), but narrower, and checks the *arguments*
of every handle, not only the callables a payload names (see ``docs/cluster.md``, "Tensor updates"):

- only the globals that torch's CPU tensor reductions emit resolve (``rebuild_tensor``, ``rebuild_typed_storage``,
  ``rebuild_storage_{fd,filename,empty}``, ``DupFd``, ``Tensor``, ``Parameter``, ``UntypedStorage``, ``Size`` and
  dtypes); anything else raises :class:`TensorTransportError`;
- nothing is opened while the pickle is read: every storage and tensor is first a *pending* record, checked, and
  opened only after the caller's ``check(name, shape, dtype)`` accepted every pair;
- a file-descriptor handle (``DupFd``) may only name a Unix socket owned by this user (the sender's
  ``multiprocessing`` listener), never a TCP address, and the file it lends must hold the storage's bytes;
- a file-name handle must be torch's ``/torch_<pid>_<n>_<n>`` of an allowed sender pid (this process, or the
  pids passed as ``allowed_pids``), an existing ``/dev/shm`` file of this user at least the storage's size, and
  its manager a Unix socket of this user;
- a view must lie inside its storage (offset, sizes and strides non-negative, last element < storage size) and
  a storage may be at most :data:`MAX_STORAGE_BYTES`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import errno
import io
import math
import multiprocessing
import os
import pickle
import re
import stat
import threading
import types
from collections.abc import Callable, Collection, Sequence
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing import reductions

from sapo_megatron.errors import UserError

MAX_STORAGE_BYTES = 1 << 40  # 1 TiB: above any one weight; a larger claimed size is a forged handle
SHM_DIR = Path("/dev/shm")
_TORCH_SHM_NAME = re.compile(r"^/torch_(?P<pid>\d+)_\d+_\d+$")  # THManagedMapAllocator's names
_CUDA_REBUILDERS = {"rebuild_cuda_tensor", "_rebuild_cuda_tensor_modified", "rebuild_event"}

# (name, shape, dtype) -> None, raising ValueError for a pair the receiver will not take.
PairCheck = Callable[[str, tuple[int, ...], torch.dtype], None]


class TensorTransportError(UserError):
    """A ``serialized_named_tensors`` entry that cannot be read here; the message says why and what to use."""


_STRATEGY_LOCK = threading.Lock()


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]], *, sharing: str | None = None) -> str:
    """One ``serialized_named_tensors`` entry: base64 of the ForkingPickler dump of ``named`` (handles, no data).

    ``sharing``: torch's sharing strategy for CPU storages during this dump (``None``: the process's current
    one, torch's default ``file_descriptor``); ``"file_system"`` makes handles any local process of this user can
    open – what a server that is not a ``multiprocessing`` child of the sender needs (real SGLang 0.5.23 on CPU:
    its scheduler dies of a ``file_descriptor`` handle it may not fetch, see docs/cluster.md). Keep the tensors
    alive until the server has answered: the payload refers to their shared memory.
    """
    for item in named:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError(
                f"serialize_named_tensors expects (name, tensor) pairs, got {type(item).__name__}"
            )
    return _dump(list(named), sharing)


def _dump(payload: object, sharing: str | None) -> str:
    buffer = io.BytesIO()
    with _STRATEGY_LOCK:
        previous = torch.multiprocessing.get_sharing_strategy()
        if sharing is not None:
            torch.multiprocessing.set_sharing_strategy(sharing)
        try:
            ForkingPickler(buffer).dump(payload)
        finally:
            torch.multiprocessing.set_sharing_strategy(previous)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# ---------------------------------------------------------------------------------------------------------------
# Flattened buckets (load_format "flattened_bucket")
# ---------------------------------------------------------------------------------------------------------------
# SGLang 0.5.23 (srt/model_executor/model_runner_components/weight_updater.py, _update_weights_from_flattened_bucket;
# srt/weight_sync/tensor_bucket.py): the payload is {"flattened_tensor": uint8 [N], "metadata": [m, ...]} and each
# m is read by attribute (name, shape, dtype, start_idx, end_idx, numel; byte offsets into the flat tensor). slime
# sends SGLang's own FlattenedTensorMetadata; the metadata here are types.SimpleNamespace, which any receiver can
# unpickle without this package. One bucket per dtype, in a fresh buffer (slime PR #929: SGLang replies before its
# copies finish, so a buffer must never be reused for the next bucket).
FLATTENED_BUCKET = "flattened_bucket"


def flattened_buckets(named: Sequence[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """One flattened bucket per dtype (in the order of first appearance), each in a new buffer."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    buckets = []
    for dtype, items in by_dtype.items():
        flats = [tensor.detach().contiguous().reshape(-1).view(torch.uint8) for _, tensor in items]
        metadata, offset = [], 0
        for (name, tensor), flat in zip(items, flats):
            metadata.append(
                types.SimpleNamespace(
                    name=name,
                    shape=torch.Size(tensor.shape),
                    dtype=dtype,
                    start_idx=offset,
                    end_idx=offset + flat.numel(),
                    numel=flat.numel(),
                )
            )
            offset += flat.numel()
        buckets.append({"flattened_tensor": torch.cat(flats), "metadata": metadata})
    return buckets


def serialize_flattened_bucket(bucket: dict[str, Any], *, sharing: str | None = "file_system") -> str:
    """One ``serialized_named_tensors`` entry of a flattened bucket (CPU tensors; handles, no data)."""
    return _dump(bucket, sharing)


def deserialize_flattened_bucket(
    data: str | bytes, *, check: PairCheck | None = None, allowed_pids: Collection[int] = ()
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) views of one flattened-bucket entry. Every metadata entry is checked (bounds,
    alignment, sizes, ``check``) before the flat tensor's storage is opened."""
    raw = _decode(data) if isinstance(data, str) else data
    unpickler = _RestrictedUnpickler(
        io.BytesIO(raw), allowed_pids={os.getpid(), *allowed_pids}, namespaces=True
    )
    try:
        loaded = unpickler.load()
    except TensorTransportError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise TensorTransportError(f"not a flattened bucket: {type(exc).__name__}: {exc}") from exc
    flat, entries = _check_flattened(loaded)
    if check is not None:
        for name, shape, dtype, _ in entries:
            try:
                check(name, shape, dtype)
            except ValueError as exc:
                raise TensorTransportError(f"{exc}; nothing was opened or changed") from exc
    try:
        opened = flat.open()
    except (OSError, RuntimeError) as exc:
        raise TensorTransportError(_unreachable_message(exc)) from exc
    return [
        (name, opened[start : start + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape))
        for name, shape, dtype, start in entries
    ]


def _check_flattened(
    loaded: object,
) -> tuple[_PendingTensor, list[tuple[str, tuple[int, ...], torch.dtype, int]]]:
    if not (isinstance(loaded, dict) and set(loaded) == {"flattened_tensor", "metadata"}):
        raise TensorTransportError(
            "a flattened bucket is {'flattened_tensor': uint8 tensor, 'metadata': [...]}"
        )
    flat, metadata = loaded["flattened_tensor"], loaded["metadata"]
    if not (isinstance(flat, _PendingTensor) and flat.typed.dtype == torch.uint8 and len(flat.shape) == 1):
        raise TensorTransportError("flattened_tensor must be a 1-D uint8 CPU tensor")
    if flat.stride != (1,) or not isinstance(metadata, list) or not metadata:
        raise TensorTransportError("flattened_tensor must be contiguous and metadata a non-empty list")
    entries, end = [], 0
    for meta in metadata:
        if not isinstance(meta, types.SimpleNamespace):
            raise TensorTransportError("flattened bucket metadata must be attribute records")
        fields = vars(meta)
        name, dtype = fields.get("name"), fields.get("dtype")
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            raise TensorTransportError(
                f"flattened bucket entry {name!r}: name must be a str and dtype a torch dtype"
            )
        shape = _ints(tuple(fields.get("shape", ())), "size")
        (start, stop, numel) = _ints(
            (fields.get("start_idx"), fields.get("end_idx"), fields.get("numel")), "offsets"
        )
        size = math.prod(shape) * dtype.itemsize
        if start != end or stop - start != numel or numel != size or start % dtype.itemsize:
            raise TensorTransportError(
                f"flattened bucket entry {name}: bytes [{start}, {stop}) do not hold a {list(shape)} {dtype} tensor "
                "right after the previous entry"
            )
        end = stop
        entries.append((name, shape, dtype, start))
    if end != flat.shape[0]:
        raise TensorTransportError(f"flattened bucket metadata covers {end} of its {flat.shape[0]} bytes")
    return flat, entries


def deserialize_named_tensors(
    data: str | bytes,
    *,
    check: PairCheck | None = None,
    allowed_pids: Collection[int] = (),
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one entry (base64 text as sent over HTTP, or the raw pickle bytes).

    ``check(name, shape, dtype)`` runs on every pair before any storage is opened (a ValueError refuses the whole
    payload); ``allowed_pids``: sender processes besides this one whose file-name (``file_system``) handles open.
    """
    raw = _decode(data) if isinstance(data, str) else data
    unpickler = _RestrictedUnpickler(io.BytesIO(raw), allowed_pids={os.getpid(), *allowed_pids})
    try:
        loaded = unpickler.load()
    except TensorTransportError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise TensorTransportError(
            f"serialized_named_tensors is not a tensor payload: {type(exc).__name__}: {exc}"
        ) from exc
    pending = _check_pairs(loaded)
    if check is not None:
        for name, tensor in pending:
            try:
                check(name, tensor.shape, tensor.typed.dtype)
            except ValueError as exc:
                raise TensorTransportError(f"{exc}; nothing was opened or changed") from exc
    try:
        return [(name, tensor.open()) for name, tensor in pending]
    except TensorTransportError:
        raise
    except (OSError, RuntimeError) as exc:  # a shared-memory file that cannot be opened
        raise TensorTransportError(_unreachable_message(exc)) from exc


def _decode(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise TensorTransportError(f"serialized_named_tensors entry is not valid base64: {exc}") from exc


def _check_pairs(loaded: object) -> list[tuple[str, _PendingTensor]]:
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
            and isinstance(item[1], _PendingTensor)
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


def _refuse(message: str) -> TensorTransportError:
    return TensorTransportError(f"serialized_named_tensors: {message}; nothing was opened")


def _own_unix_socket(address: object, what: str) -> str:
    """``address`` if it is the path of a Unix socket owned by this user, else refused (no TCP, no other user)."""
    if isinstance(address, bytes):
        address = address.decode("utf-8", "replace")
    if not isinstance(address, str) or not address.startswith("/"):
        raise _refuse(f"{what} {address!r} is not a local Unix socket path (network addresses are refused)")
    try:
        info = os.stat(address)
    except OSError:
        raise _refuse(f"{what} {address!r} does not exist") from None
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
        raise _refuse(f"{what} {address!r} is not a Unix socket of this user")
    return address


def _storage_size(size: object) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_STORAGE_BYTES:
        raise _refuse(f"storage size {size!r} is not an int in [0, {MAX_STORAGE_BYTES}]")
    return size


class _SharedFd(resource_sharer.DupFd):
    """``DupFd`` whose address is checked when unpickled and whose fetch failure says why (no fd is fetched
    until the payload is accepted)."""

    def __setstate__(self, state: object) -> None:
        ident = state.get("_id") if isinstance(state, dict) else None
        if not (isinstance(ident, tuple) and len(ident) == 2 and isinstance(ident[1], int)):
            raise _refuse("a DupFd handle without an (address, key) identifier")
        own = getattr(getattr(resource_sharer, "_resource_sharer", None), "_address", None)  # private
        if ident[0] != own:
            _own_unix_socket(ident[0], "DupFd address")
        self._id = ident

    def detach(self) -> int:
        try:
            return super().detach()
        except (multiprocessing.AuthenticationError, OSError, EOFError) as exc:
            raise TensorTransportError(_unreachable_message(exc)) from exc


@dataclasses.dataclass(eq=False)
class _PendingStorage:
    """An untyped CPU storage named by a handle, opened on :meth:`open` (once; shared by the views of it)."""

    nbytes: int
    opener: Callable[[], torch.UntypedStorage]
    opened: torch.UntypedStorage | None = None

    def open(self) -> torch.UntypedStorage:
        if self.opened is None:
            self.opened = self.opener()
        return self.opened


@dataclasses.dataclass(eq=False)
class _PendingTyped:
    storage: _PendingStorage
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return self.storage.nbytes // self.dtype.itemsize


@dataclasses.dataclass(eq=False)
class _PendingTensor:
    cls: type
    typed: _PendingTyped
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool

    def open(self) -> torch.Tensor:
        typed = reductions.rebuild_typed_storage(self.typed.storage.open(), self.typed.dtype)
        metadata = (self.offset, torch.Size(self.shape), self.stride, self.requires_grad)
        return reductions.rebuild_tensor(self.cls, typed, metadata)


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise _refuse(f"tensor {what} {value!r} is not a list of non-negative ints")
    return tuple(value)


def _pending_tensor(cls: object, typed: object, metadata: object) -> _PendingTensor:
    if cls not in (torch.Tensor, torch.nn.Parameter):
        raise _refuse(f"tensor class {cls!r} is not Tensor or Parameter")
    if not isinstance(typed, _PendingTyped):
        raise _refuse("a tensor without a shared storage handle")
    if not (isinstance(metadata, tuple) and len(metadata) == 4):
        raise _refuse("tensor metadata is not (offset, size, stride, requires_grad)")
    offset, shape, strides, requires_grad = metadata
    (offset,) = _ints((offset,), "storage offset")
    shape, strides = _ints(shape, "size"), _ints(strides, "stride")
    if len(shape) != len(strides):
        raise _refuse(f"tensor size {list(shape)} and stride {list(strides)} differ in length")
    if math.prod(shape) > 0:
        last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
        if last >= typed.numel:
            raise _refuse(
                f"a {list(shape)} view (offset {offset}, stride {list(strides)}) reaches element {last} of a "
                f"{typed.numel}-element storage"
            )
    return _PendingTensor(cls, typed, offset, shape, strides, bool(requires_grad))


def _pending_typed(storage: object, dtype: object) -> _PendingTyped:
    if not isinstance(storage, _PendingStorage) or not isinstance(dtype, torch.dtype):
        raise _refuse("a typed storage that is not (shared storage handle, dtype)")
    return _PendingTyped(storage, dtype)


def _pending_fd(cls: object, handle: object, size: object) -> _PendingStorage:
    if cls is not torch.UntypedStorage or not isinstance(handle, _SharedFd):
        raise _refuse("a file-descriptor storage that is not (UntypedStorage, DupFd, size)")
    nbytes = _storage_size(size)

    def opener() -> torch.UntypedStorage:
        fd = handle.detach()
        try:
            if os.fstat(fd).st_size < nbytes:
                raise _refuse(f"the lent file holds fewer than the {nbytes} bytes its handle claims")
            return reductions.rebuild_storage_fd(cls, _Detached(os.dup(fd)), nbytes)
        finally:
            os.close(fd)

    return _PendingStorage(nbytes, opener)


class _Detached:
    """The ``df`` argument of torch's ``rebuild_storage_fd``: an fd already fetched and checked."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def detach(self) -> int:
        return self.fd


def _pending_filename(
    allowed_pids: Collection[int],
) -> Callable[..., _PendingStorage]:
    def pending(
        cls: object, manager: object, handle: object, size: object, dtype: object = None
    ) -> _PendingStorage:
        if cls is not torch.UntypedStorage or dtype is not None:
            raise _refuse("a file-name storage that is not (UntypedStorage, manager, name, size)")
        name = handle.decode("utf-8", "replace") if isinstance(handle, bytes) else handle
        match = _TORCH_SHM_NAME.match(name) if isinstance(name, str) else None
        if match is None or int(match["pid"]) not in allowed_pids:
            raise _refuse(
                f"shared-memory name {handle!r} is not one torch made in an allowed sender process "
                f"(pids {sorted(allowed_pids)}; a server in another process takes the trainer's pid by "
                "--tensor-sender-pid)"
            )
        nbytes = _storage_size(size)
        cached = reductions.storage_from_cache(torch.UntypedStorage, handle)
        if cached is None:  # not this process's own storage: the file must be the sender's, already that big
            _own_unix_socket(manager, "torch shared-memory manager")
            try:
                info = os.stat(SHM_DIR / match.string.lstrip("/"))  # match.string: name, a str
            except OSError:
                raise _refuse(f"shared-memory file {name!r} does not exist") from None
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size < nbytes:
                raise _refuse(
                    f"shared-memory file {name!r} is not a file of this user holding {nbytes} bytes"
                )
        return _PendingStorage(
            nbytes, lambda: reductions.rebuild_storage_filename(cls, manager, handle, nbytes)
        )

    return pending


def _pending_empty(cls: object) -> _PendingStorage:
    if cls is not torch.UntypedStorage:
        raise _refuse("an empty storage that is not an UntypedStorage")
    return _PendingStorage(0, lambda: reductions.rebuild_storage_empty(cls))


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, *, allowed_pids: Collection[int], namespaces: bool = False) -> None:
        super().__init__(file)
        self._globals: dict[tuple[str, str], Any] = {
            **({("types", "SimpleNamespace"): types.SimpleNamespace} if namespaces else {}),
            ("torch", "Tensor"): torch.Tensor,
            ("torch", "Size"): torch.Size,
            ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
            ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
            ("multiprocessing.resource_sharer", "DupFd"): _SharedFd,
            ("torch.multiprocessing.reductions", "rebuild_tensor"): _pending_tensor,
            ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _pending_typed,
            ("torch.multiprocessing.reductions", "rebuild_storage_fd"): _pending_fd,
            ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _pending_filename(allowed_pids),
            ("torch.multiprocessing.reductions", "rebuild_storage_empty"): _pending_empty,
        }

    def find_class(self, module: str, name: str) -> object:
        if name in _CUDA_REBUILDERS or module.startswith("torch.cuda"):
            raise TensorTransportError(
                "serialized_named_tensors holds CUDA tensors (CUDA IPC handles); this server keeps its model on "
                "CPU: send CPU tensors"
            )
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self._globals:
            return self._globals[(module, name)]
        raise TensorTransportError(
            f"serialized_named_tensors refers to {module}.{name}, which is not allowed"
        )
