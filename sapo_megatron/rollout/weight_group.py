"""The weight-update process group between a trainer (rank 0) and rollout servers, as SGLang forms it.

SGLang's ``POST /init_weights_update_group`` makes every server TP rank call ``init_custom_process_group`` (SGLang
``python/sglang/srt/utils/common.py``; called from ``ModelRunner.init_weights_update_group`` in
``python/sglang/srt/model_executor/model_runner.py``) with ``init_method=tcp://{master_address}:{master_port}`` and
``rank = rank_offset + tp_rank``; the trainer joins the same group as rank 0, whose process hosts the TCP store.
``POST /update_weights_from_distributed`` then makes each server rank ``broadcast(src=0)`` one tensor per requested
name, in request order (async ops, then wait), and load them. :func:`init_custom_process_group` here builds the group
the same way, so the trainer can use it against a real SGLang server (``nccl`` on GPUs) and against our CPU server
(``gloo``); the CPU server uses it for its own (single) rank.

The group lives beside the default process group and never touches it: it gets its own TCP store (hosted by rank 0, see ``_tcp_store``),
prefixed by the group name, and ``torch.distributed.distributed_c10d._new_process_group_helper`` builds it without
the default group (a process without one, like the CPU server, is fine). What this relies on (torch 2.6 - 2.13):

- public: ``TCPStore``, ``PrefixStore``, ``Backend``, ``broadcast(..., group=, async_op=True)``,
  ``Work.is_completed``, ``destroy_process_group(group)``;
- private, guarded by :func:`_private_api` (a clear error if torch renamed them): ``_new_process_group_helper``
  (its options keyword is ``backend_options`` since 2.6, ``pg_options`` before; chosen by signature),
  ``_world.pg_group_ranks`` (SGLang registers the identity rank map so that ``src=0`` means group rank 0), and
  ``ProcessGroup.bound_device_id`` (see :func:`_unbound_default_group`).

Timeouts: ``timeout`` bounds forming the group (the store connection, every rank's arrival) and each collective.
A wrong ``world_size`` or an unreachable master raise :class:`WeightGroupError` after ``timeout``, never hang.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import secrets
import socket
import struct
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from sapo_megatron.errors import UserError
from sapo_megatron.runtime.interrupts import WaitInterrupted, stop_requested

DEFAULT_TIMEOUT_S = 1800.0  # torch's default_pg_timeout; SGLang passes none, so its groups use this too
SUPPORTED_BACKENDS = ("gloo", "nccl")


class WeightGroupError(UserError):
    """The weight-update group could not be formed, or a transfer over it failed or was refused."""


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: datetime.timedelta | float | None = None,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the weight-update group ``group_name``; returns when all ``world_size`` ranks joined.

    ``rank`` 0 is the trainer and starts the TCP store on ``master_address:master_port``; a server rank is
    ``rank_offset + tp_rank``. ``timeout`` (seconds or timedelta, default 30 min) bounds forming the group and
    every later collective on it. Raises :class:`WeightGroupError` naming the group and the likely cause.
    """
    check_backend(backend)
    if not 0 <= rank < world_size:
        raise WeightGroupError(f"rank {rank} is outside world_size {world_size} of group {group_name!r}")
    if not group_name:
        raise WeightGroupError("group_name cannot be empty")
    if group_name in _registered_group_names():
        raise WeightGroupError(
            f"a process group named {group_name!r} already exists in this process; destroy it first (a trainer "
            "and a server in the same process cannot both join one group: use update_weights_from_tensor there)"
        )
    timeout = as_timedelta(timeout)
    url = f"tcp://{master_address}:{master_port}"
    started = time.monotonic()
    try:
        return _build_group(backend, url, world_size, rank, group_name, timeout)
    except WeightGroupError:
        raise
    except (RuntimeError, ValueError, TimeoutError, OSError) as exc:  # DistError subclasses RuntimeError
        raise WeightGroupError(
            f"weight-update group {group_name!r} did not form (rank {rank} of world_size {world_size}, "
            f"{backend} over {url}, after {time.monotonic() - started:.1f}s, timeout "
            f"{timeout.total_seconds():g}s): {_first_line(exc)}. Check that world_size counts the trainer (rank 0) "
            "plus every server TP rank, that each server joins at its rank_offset and that the trainer joins as "
            "rank 0 while the servers wait"
        ) from exc


_STORE_VALIDATE = struct.pack("<BI", 0, 0x3C85F7CE)
"""torch's TCPStore client greeting: QueryType VALIDATE (0) and ``validationMagicNumber``
(``torch/csrc/distributed/c10d/TCPStore.cpp``, ``TCPStoreBackend.hpp``); PING (13) then echoes a nonce."""
_STORE_PING = 13


def probe_store(address: str, port: int, timeout_s: float) -> str | None:
    """Whether a torch TCP store answers at ``address:port`` within ``timeout_s`` (None), else why not.

    torch's own client sends the same greeting and ping, but waits for the echo without a limit: against a peer
    that accepts the connection and never answers (an HTTP port) it hangs for good, whatever its timeout says.
    """
    nonce = secrets.randbits(32)
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            conn.sendall(_STORE_VALIDATE + struct.pack("<BI", _STORE_PING, nonce))
            echo = b""
            while len(echo) < 4:
                chunk = conn.recv(4 - len(echo))
                if not chunk:
                    return f"{address}:{port} closed the connection: it is not a torch TCP store"
                echo += chunk
    except TimeoutError:
        return f"{address}:{port} did not answer as a torch TCP store within {timeout_s:g}s (is it another service?)"
    except OSError as exc:
        return f"cannot connect to {address}:{port} ({exc.strerror or exc})"
    if struct.unpack("<I", echo)[0] != nonce:
        return f"{address}:{port} answered, but not as a torch TCP store"
    return None


def check_backend(backend: str) -> None:
    """Refuse a backend this machine cannot run (``nccl`` needs CUDA)."""
    if backend not in SUPPORTED_BACKENDS:
        raise WeightGroupError(f"backend {backend!r} is not supported; use one of {list(SUPPORTED_BACKENDS)}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise WeightGroupError(
            "backend 'nccl' needs CUDA, which this machine does not have: use backend 'gloo' on CPU"
        )


def broadcast_bucket(
    group: dist.ProcessGroup,
    tensors: Sequence[torch.Tensor],
    *,
    reply: Future | None = None,
    timeout_s: float | None = None,
    poll_s: float = 0.01,
) -> None:
    """Broadcast ``tensors`` from group rank 0, in order (rank 0 sends them; other ranks receive into them).

    On the trainer (rank 0), ``reply`` is the pending HTTP reply of ``/update_weights_from_distributed``: if it
    completes with an error while the broadcasts still wait for a receiver (the server refused the request before
    receiving anything), this raises :class:`WeightGroupError` with the server's reason at once instead of waiting
    for the group's timeout; the group then holds unmatched sends, so destroy it on both sides and form it anew.
    ``timeout_s`` bounds the wait here (the group's own timeout applies regardless).
    """
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for work in works:
        while not work.is_completed():
            _raise_if_refused(reply)
            if stop_requested():  # a signal on the trainer: stop waiting, the run checkpoints and resumes
                raise WaitInterrupted(f"broadcast of {len(works)} tensors: interrupted by a signal")
            if deadline is not None and time.monotonic() > deadline:
                raise WeightGroupError(
                    f"broadcast of {len(works)} tensors did not complete in {timeout_s:g}s"
                )
            time.sleep(poll_s)
        work.wait()  # raises the collective's own error (e.g. a gloo timeout), if any


def destroy_custom_process_group(group: dist.ProcessGroup) -> None:
    """Leave and free a group made by :func:`init_custom_process_group` (the default group is untouched)."""
    dist.destroy_process_group(group)  # also drops the group's entries in torch's registry


def tensor_metadata(
    named: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[str], list[str], list[list[int]]]:
    """``names``, ``dtypes`` and ``shapes`` of ``/update_weights_from_distributed`` for tensors sent in this order.

    dtypes are torch attribute names (``"bfloat16"``), which SGLang resolves with ``getattr(torch, dtype)``.
    """
    return (
        [name for name, _ in named],
        [dtype_name(t.dtype) for _, t in named],
        [list(t.shape) for _, t in named],
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``getattr(torch, name)`` like SGLang, with an error naming the bad value."""
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return value


def as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta:
    if timeout is None:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if timeout <= 0:
        raise WeightGroupError(f"timeout must be positive, got {timeout}")
    return datetime.timedelta(seconds=float(timeout))


# ---------------------------------------------------------------------------------------------------- internals
def _build_group(
    backend: str, url: str, world_size: int, rank: int, group_name: str, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    new_group_helper, world = _private_api()
    # SGLang's layout: keys of different groups cannot collide
    store = dist.PrefixStore(group_name, _tcp_store(url, rank, world_size, timeout))
    options_keyword = (
        "backend_options"
        if "backend_options" in inspect.signature(new_group_helper).parameters
        else "pg_options"
    )
    with _unbound_default_group():
        group, _ = new_group_helper(
            world_size,
            rank,
            [],
            dist.Backend(backend),
            store,
            group_name=group_name,
            timeout=timeout,
            **{options_keyword: None},
        )
    world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _tcp_store(url: str, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's TCP store, hosted by rank 0, as SGLang's ``rendezvous(tcp://...)`` makes it
    (``_create_c10d_store``: ``is_master = rank == 0``, multi-tenant).

    Not ``dist.rendezvous`` itself: in a process started by torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) it
    makes every rank a client of a store that torchrun's agent would host, so for this group nobody would host
    it and all ranks would wait until the timeout (measured: a trainer under torchrun hung here)."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise WeightGroupError(f"the group's address {url!r} is not tcp://host:port")
    return dist.TCPStore(
        parts.hostname,
        parts.port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )


def _private_api():
    from torch.distributed import distributed_c10d

    helper = getattr(distributed_c10d, "_new_process_group_helper", None)
    world = getattr(distributed_c10d, "_world", None)
    if helper is None or not hasattr(world, "pg_group_ranks"):
        raise WeightGroupError(
            f"torch {torch.__version__} lacks distributed_c10d._new_process_group_helper/_world, which the "
            "weight-update group needs (available in torch 2.6 - 2.13)"
        )
    return helper, world


def _world():
    return _private_api()[1]


def _registered_group_names() -> set[str]:
    return set(getattr(_world(), "pg_names", {}).values())


@contextlib.contextmanager
def _unbound_default_group() -> Iterator[None]:
    """Hide the default group's bound device while the new group is built.

    With a bound device (``init_process_group(device_id=...)``), torch >= 2.4 would create an NCCL group by
    ``ncclCommSplit`` from the default group's communicator, which the servers (other jobs) are not part of.
    """
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    bound = getattr(default, "bound_device_id", None)
    if default is None or bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def _raise_if_refused(reply: Future | None) -> None:
    """Raise if ``reply`` finished with an exception or with ``{"success": false, ...}``."""
    if reply is None or not reply.done():
        return
    error = reply.exception()
    result = reply.result() if error is None else None
    if error is not None:
        reason: object = error
    elif isinstance(result, dict) and result.get("success") is False:
        reason = result.get("message")
    else:
        return
    raise WeightGroupError(
        f"the server refused the weight update while the trainer was broadcasting: {reason}",
        hint="destroy the weight-update group on both sides (POST /destroy_weights_update_group) and form it "
        "again before the next update",
    ) from error


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
