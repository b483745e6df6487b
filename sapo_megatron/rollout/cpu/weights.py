"""The weight-sync endpoints of :mod:`cpu_server`, with SGLang's request fields, replies and messages.

Checked against SGLang (``python/sglang/srt/managers/io_struct.py`` request classes,
``python/sglang/srt/entrypoints/http_server.py`` handlers, ``python/sglang/srt/model_executor/model_runner.py``
``update_weights_from_disk`` / ``init_weights_update_group`` / ``destroy_weights_update_group`` /
``update_weights_from_distributed`` / ``update_weights_from_tensor``):

- every reply is ``{"success": bool, "message": str}`` (``/update_weights_from_disk`` adds
  ``num_paused_requests``), HTTP 200 on success and 400 on failure; when a request carries ``weight_version`` and
  succeeds, the server's weight version becomes that string and the message gets " Weight version updated to X.";
- a body that does not fit the request class (missing or mistyped field) is HTTP 400 with FastAPI's validation
  shape ``{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}``. Unknown fields are
  refused too (SGLang ignores them), so that a misspelt field is not silently dropped.

Where this server differs from SGLang, on purpose:

- ``/update_weights_from_distributed`` checks names, shapes and dtypes against the model (and that the group
  exists) BEFORE receiving anything, and refuses a bad request at once with 400; SGLang receives every tensor first
  and fails while loading, leaving the weights partly updated. Tensors are received in full, then loaded in one
  step: a failed transfer changes nothing. The trainer must therefore not wait forever on its broadcast:
  :func:`~sapo_megatron.rollout.weight_group.broadcast_bucket` watches the HTTP reply and stops when it fails.
- The group uses ``--dist-timeout`` (default 30 min, torch's default, which SGLang's groups get) for forming and
  for each broadcast; SGLang has no per-request timeout either.
- Guards (:class:`WeightGuard`; SGLang has none of them, see ``docs/cluster.md``): ``/update_weights_from_tensor``
  is answered 403 unless the request comes from a loopback address, and its payload's handles are checked before
  anything is opened (:func:`~sapo_megatron.rollout.tensor_transport.deserialize_named_tensors`; names, shapes and
  a floating-point dtype against the model); ``/update_weights_from_disk`` loads only directories inside
  ``allowed_weight_dirs`` (symlinks resolved); ``/init_weights_update_group`` dials only the request's own peer
  address (or loopback, or one of ``allowed_master_addresses``), and first checks within ``connect_timeout_s``
  that the master's port answers.
- Accepted fields that mean nothing on a CPU server and are ignored: ``flush_cache`` (no prefix cache),
  ``abort_all_requests`` (requests in flight finish on the old weights; the update waits for the running batch),
  ``torch_empty_cache``, ``disable_draft_model``, ``is_async``, ``keep_pause``, ``recapture_cuda_graph``,
  ``token_step``. ``load_format`` ``flattened_bucket`` (one flattened tensor per dtype, every entry checked before
  its storage opens: :func:`~sapo_megatron.rollout.tensor_transport.deserialize_flattened_bucket`) is taken;
  custom loaders are refused with a clear message.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import socket
import threading
import time
from collections.abc import Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any

import torch

from sapo_megatron.rollout.cpu.engine import CPUEngine
from sapo_megatron.rollout.cpu.flags import DEFAULT_CONNECT_TIMEOUT_S
from sapo_megatron.rollout.cpu.http import Request
from sapo_megatron.rollout.tensor_transport import (
    FLATTENED_BUCKET,
    TensorTransportError,
    deserialize_flattened_bucket,
    deserialize_named_tensors,
)
from sapo_megatron.rollout.weight_group import (
    DEFAULT_TIMEOUT_S,
    WeightGroupError,
    broadcast_bucket,
    check_backend,
    destroy_custom_process_group,
    init_custom_process_group,
    parse_dtype,
    probe_store,
)

logger = logging.getLogger(__name__)

Reply = tuple[HTTPStatus, dict[str, Any]]
_REQUIRED = object()
_OPTIONAL_STR = (str, type(None))
_COMMON_UPDATE_FIELDS: dict[str, tuple[type | tuple[type, ...], Any]] = {
    "flush_cache": (bool, True),
    "abort_all_requests": (bool, False),
    "weight_version": (_OPTIONAL_STR, None),
    "torch_empty_cache": (bool, False),
}


class InvalidRequest(ValueError):
    """The body does not fit the endpoint's request class; answered like FastAPI's validation error (400)."""


_LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclasses.dataclass(frozen=True)
class WeightGuard:
    """What the weight endpoints accept beyond a well-formed body (see the module docstring).

    ``allowed_weight_dirs``: directories ``update_weights_from_disk`` may load from (their subdirectories too);
    ``None`` means the parent directory of the model the engine loaded first. ``allowed_master_addresses``: master
    addresses besides the request's own peer and loopback. ``tensor_sender_pids``: processes besides this one
    whose shared-memory (``file_system``) tensor handles may be opened.
    """

    allowed_weight_dirs: Sequence[str | Path] | None = None
    allowed_master_addresses: Sequence[str] = ()
    tensor_sender_pids: Sequence[int] = ()
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S


@dataclasses.dataclass
class _Group:
    group: Any  # torch.distributed.ProcessGroup
    device: torch.device
    backend: str


class WeightEndpoints:
    """``/update_weights_from_{disk,tensor,distributed}``, ``/{init,destroy}_weights_update_group`` of one engine.

    Updates run one at a time (broadcasts of one group must stay in request order); generation continues while a
    transfer is received and pauses only for the copy into the model.
    """

    def __init__(
        self,
        engine: CPUEngine,
        *,
        dist_timeout_s: float = DEFAULT_TIMEOUT_S,
        guard: WeightGuard | None = None,
    ) -> None:
        self.engine = engine
        self.dist_timeout_s = dist_timeout_s
        self.guard = guard or WeightGuard()
        dirs = self.guard.allowed_weight_dirs
        if dirs is None:
            dirs = [Path(engine.model_path).parent] if engine.model_path else []
        self.allowed_weight_dirs = [Path(d).resolve() for d in dirs]
        self.version_label: str | None = None  # set by a request's weight_version, as SGLang does
        self._labels: dict[int, str] = {}  # engine weight version -> the label an update set there
        self._groups: dict[str, _Group] = {}
        self._update_lock = threading.Lock()
        self.session_open = False  # a weight-update session (begin_weight_update .. end_weight_update)
        self.sessions_closed = 0  # sessions ended so far (what tests read to see that a client used them)

    @property
    def weight_version(self) -> str:
        return self.version_label if self.version_label is not None else str(self.engine.weight_version)

    def label_of(self, engine_version: int) -> str:
        """The ``weight_version`` the server reported while the engine held ``engine_version`` (a label persists
        until another update sets one, as in SGLang)."""
        set_at = [v for v in self._labels if v <= engine_version]
        return self._labels[max(set_at)] if set_at else str(engine_version)

    def close(self) -> None:
        for name in list(self._groups):
            self._destroy(name)

    # ------------------------------------------------------------------ sessions
    # SGLang 0.5.23 (srt/entrypoints/http_server.py /begin_weight_update, /end_weight_update;
    # srt/managers/scheduler_components/weight_updater.py): the body is {"selector": "target"|"draft"|"all"} (begin)
    # or {} (end); the reply is {"success", "message"}, 200 with "Success", 400 when a session is already open
    # (begin) or none is (end). Unlike SGLang, this server also takes tensor and distributed updates outside a
    # session (older SGLang's behaviour, which the tests of those endpoints rely on).
    def begin_session(self, body: dict[str, Any], request: Request | None = None) -> Reply:
        fields = _fields(body, {"selector": (str, "all"), "rid": (_OPTIONAL_STR, None)})
        if fields["selector"] not in ("target", "draft", "all"):
            raise InvalidRequest("selector must be 'target', 'draft' or 'all'")
        with self._update_lock:
            if self.session_open:
                return _failure("a weight-update session is already open; call end_weight_update() first")
            self.session_open = True
        return HTTPStatus.OK, {"success": True, "message": "Success"}

    def end_session(self, body: dict[str, Any], request: Request | None = None) -> Reply:
        _fields(body, {"rid": (_OPTIONAL_STR, None)})
        with self._update_lock:
            if not self.session_open:
                return _failure("no weight-update session is open; call begin_weight_update() first")
            self.session_open = False
            self.sessions_closed += 1
        return HTTPStatus.OK, {"success": True, "message": "Success"}

    # ------------------------------------------------------------------ disk
    def update_from_disk(self, body: dict[str, Any], request: Request | None = None) -> Reply:
        fields = _fields(
            body,
            {
                "model_path": (str, _REQUIRED),
                "load_format": (_OPTIONAL_STR, None),
                **_COMMON_UPDATE_FIELDS,
                "is_async": (bool, False),
                "keep_pause": (bool, False),
                "recapture_cuda_graph": (bool, False),
                "token_step": (int, 0),
            },
        )
        if fields["load_format"] not in (None, "auto", "safetensors"):
            message = f"Failed to update weights: load_format {fields['load_format']!r} is not supported"
            return _failure(message, num_paused_requests=0)
        refused = self._refused_dir(fields["model_path"])
        if refused is not None:
            return _failure(f"Failed to update weights: {refused}", num_paused_requests=0)
        with self._update_lock:
            try:
                self.engine.update_weights_from_disk(fields["model_path"])
            except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
                return _failure(f"Failed to update weights: {exc}", num_paused_requests=0)
            message = self._label("Succeeded to update model weights.", fields["weight_version"])
        return HTTPStatus.OK, {"success": True, "message": message, "num_paused_requests": 0}

    def _refused_dir(self, model_path: str) -> str | None:
        """Why ``model_path`` may not be loaded, or None (inside an allowed directory, symlinks resolved)."""
        if "\x00" in model_path:
            return "model_path holds a NUL character"
        resolved = Path(model_path).resolve()
        if self._allowed(resolved):
            return self._file_outside(Path(model_path), resolved)
        allowed = ", ".join(str(d) for d in self.allowed_weight_dirs) or "none"
        return (
            f"{model_path} is outside the directories this server loads weights from ({allowed}); start the "
            "server with --allowed-weight-dir DIR for the trainer's weight_sync_dir"
        )

    def _allowed(self, resolved: Path) -> bool:
        return any(resolved == d or d in resolved.parents for d in self.allowed_weight_dirs)

    def _file_outside(self, model_path: Path, resolved: Path) -> str | None:
        """A file link in the checkpoint folder that leads outside the allowed directories (the loader would
        follow it), named without a word about its target."""
        if not resolved.is_dir():
            return None
        for entry in sorted(resolved.iterdir()):
            if entry.is_symlink() and not self._allowed(entry.resolve()):
                return (
                    f"{model_path}/{entry.name} is a symbolic link that leads outside the directories this "
                    "server loads weights from"
                )
        return None

    # ------------------------------------------------------------------ tensor
    def update_from_tensor(self, body: dict[str, Any], request: Request | None = None) -> Reply:
        fields = _fields(
            body,
            {
                "serialized_named_tensors": (list, _REQUIRED),
                "load_format": (_OPTIONAL_STR, None),
                **_COMMON_UPDATE_FIELDS,
                "disable_draft_model": ((bool, type(None)), None),
            },
        )
        if request is not None and not request.from_loopback:
            return HTTPStatus.FORBIDDEN, {
                "success": False,
                "message": f"update_weights_from_tensor is only taken from this machine (loopback), not from "
                f"{request.peer_host}: tensor payloads are handles to the sender's memory. Use "
                "update_weights_from_distributed or update_weights_from_disk across machines",
            }
        entries = fields["serialized_named_tensors"]
        if not entries or not all(isinstance(e, str) for e in entries):
            raise InvalidRequest(
                "serialized_named_tensors must be a non-empty list of base64 strings, one per TP rank"
            )
        load_format = fields["load_format"]
        if load_format not in (None, "direct", FLATTENED_BUCKET):
            return _failure(
                f"load_format {load_format!r} is not supported by the CPU server; send null or {FLATTENED_BUCKET}"
            )
        read = deserialize_flattened_bucket if load_format == FLATTENED_BUCKET else deserialize_named_tensors
        with self._update_lock:
            try:
                named = read(  # this server is TP rank 0 of 1
                    entries[0], check=self._check_tensor, allowed_pids=self.guard.tensor_sender_pids
                )
                self.engine.update_weights_from_tensors(named)
            except (TensorTransportError, ValueError) as exc:
                return _failure(f"Failed to update weights from tensor: {exc}")
            message = self._label("Success", fields["weight_version"])
        return HTTPStatus.OK, {"success": True, "message": message}

    def _check_tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"weight {name} has dtype {dtype}, the model's weights are floating point")
        self.engine.weight_targets([(name, shape)])  # unknown name, other shape: ValueError

    # ------------------------------------------------------------------ distributed
    def init_group(self, body: dict[str, Any], request: Request | None = None) -> Reply:
        fields = _fields(
            body,
            {
                "master_address": (str, _REQUIRED),
                "master_port": (int, _REQUIRED),
                "rank_offset": (int, _REQUIRED),
                "world_size": (int, _REQUIRED),
                "group_name": (str, "weight_update_group"),
                "backend": (str, "nccl"),
            },
        )
        name, backend = fields["group_name"], fields["backend"]
        if name in self._groups:
            return _failure(f"Failed to initialize custom process group: group {name!r} already exists.")
        try:
            check_backend(backend)
        except WeightGroupError as exc:
            return _failure(f"Failed to initialize custom process group: {exc}.")
        refused = self._refused_master(fields["master_address"], fields["master_port"], request)
        if refused is not None:
            logger.error("init_weights_update_group refused: %s", refused)
            return _failure(f"Failed to initialize custom process group: {refused}.")
        try:
            group = init_custom_process_group(
                backend,
                fields["master_address"],
                fields["master_port"],
                fields["world_size"],
                fields["rank_offset"],  # + tp_rank 0: this server has one rank
                name,
                timeout=self.dist_timeout_s,
            )
        except WeightGroupError as exc:
            logger.error("init_weights_update_group failed: %s", exc)
            return _failure(f"Failed to initialize custom process group: {exc}.")
        device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        self._groups[name] = _Group(group, device, backend)
        return HTTPStatus.OK, {"success": True, "message": "Succeeded to initialize custom process group."}

    def _refused_master(self, address: str, port: int, request: Request | None) -> str | None:
        """Why the group's master may not be dialled, or None: it must be the requester (or loopback, or listed)
        and answer on its port within ``connect_timeout_s``, so that the endpoint can neither probe other hosts
        nor hold a thread for ``--dist-timeout``."""
        allowed = {*_LOOPBACK, *self.guard.allowed_master_addresses}
        if request is not None:
            allowed.add(request.peer_host)
        try:
            resolved = {info[4][0] for info in socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)}
        except (OSError, UnicodeError):
            resolved = set()
        if address not in allowed and not (resolved and resolved <= allowed):
            return (
                f"master_address {address} is neither the requesting trainer nor an allowed address; start the "
                "server with --allowed-master-address ADDR to join groups hosted elsewhere"
            )
        if not 0 < port < 65536:
            return f"master_port {port} is not a TCP port"
        return self._unanswered_store(address, port)

    def _unanswered_store(self, address: str, port: int) -> str | None:
        """Why no torch TCP store answers at ``address:port`` within ``connect_timeout_s``, retried while the
        trainer may still be starting it; a port that accepts and never answers (HTTP) ends at the deadline."""
        timeout = self.guard.connect_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            problem = probe_store(address, port, max(0.1, min(timeout, deadline - time.monotonic())))
            if problem is None:
                return None
            if time.monotonic() >= deadline:
                return (
                    f"no weight-update group store answered at {address}:{port} within {timeout:g}s "
                    f"(--weight-group-connect-timeout): {problem}; the trainer must host the group's store there"
                )
            time.sleep(0.1)

    def destroy_group(self, body: dict[str, Any], request: Request | None = None) -> Reply:
        name = _fields(body, {"group_name": (str, "weight_update_group")})["group_name"]
        if name not in self._groups:
            return _failure("The group to be destroyed does not exist.")
        self._destroy(name)
        return HTTPStatus.OK, {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_from_distributed(self, body: dict[str, Any], request: Request | None = None) -> Reply:
        fields = _fields(
            body,
            {
                "names": (list, _REQUIRED),
                "dtypes": (list, _REQUIRED),
                "shapes": (list, _REQUIRED),
                "group_name": (str, "weight_update_group"),
                "load_format": (_OPTIONAL_STR, None),
                **_COMMON_UPDATE_FIELDS,
            },
        )
        with self._update_lock:
            try:
                group, specs = self._check_distributed(fields)
            except ValueError as exc:  # refused before any broadcast: the trainer's sends stay unmatched
                return _failure(f"Failed to update parameter online: {exc}. Nothing was received or changed.")
            tensors = [torch.empty(shape, dtype=dtype, device=group.device) for dtype, shape in specs]
            try:
                broadcast_bucket(group.group, tensors)
            except (RuntimeError, WeightGroupError) as exc:
                return _failure(
                    f"Failed to update parameter online: {exc}. The model's weights are unchanged; destroy and "
                    "re-initialize the weights update group."
                )
            self.engine.update_weights_from_tensors(zip(fields["names"], tensors))
            message = self._label("Succeeded to update parameter online.", fields["weight_version"])
        return HTTPStatus.OK, {"success": True, "message": message}

    def _check_distributed(
        self, fields: dict[str, Any]
    ) -> tuple[_Group, list[tuple[torch.dtype, list[int]]]]:
        names, dtypes, shapes = fields["names"], fields["dtypes"], fields["shapes"]
        group = self._groups.get(fields["group_name"])
        if group is None:
            raise ValueError(
                f"Group {fields['group_name']} not in {list(self._groups)}. "
                "Please call `init_weights_update_group` first"
            )
        if fields["load_format"] is not None:
            raise ValueError(
                f"load_format {fields['load_format']!r} is not supported by the CPU server; send null"
            )
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names, dtypes and shapes have {len(names)}, {len(dtypes)}, {len(shapes)} entries"
            )
        for name, shape in zip(names, shapes):
            if not isinstance(name, str):
                raise ValueError(f"names must be strings, got {name!r}")
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"shape of {name} must be a list of non-negative ints, got {shape!r}")
        specs = [(parse_dtype(dtype), shape) for dtype, shape in zip(dtypes, shapes)]
        self.engine.weight_targets(list(zip(names, shapes)))  # unknown names, wrong shapes
        return group, specs

    def _destroy(self, name: str) -> None:
        entry = self._groups.pop(name)
        try:
            destroy_custom_process_group(entry.group)
        except RuntimeError as exc:
            logger.warning("destroying weights update group %s: %s", name, exc)

    def _label(self, message: str, weight_version: str | None) -> str:
        if weight_version is None:
            return message
        self.version_label = weight_version
        self._labels[self.engine.weight_version] = weight_version
        return f"{message} Weight version updated to {weight_version}."


def _failure(message: str, **extra: Any) -> Reply:
    return HTTPStatus.BAD_REQUEST, {"success": False, "message": message, **extra}


def _fields(body: dict[str, Any], spec: dict[str, tuple[type | tuple[type, ...], Any]]) -> dict[str, Any]:
    """Check ``body`` against ``{field: (type(s), default or _REQUIRED)}``; returns every field's value."""
    unknown = sorted(set(body) - set(spec))
    if unknown:
        raise InvalidRequest(f"unknown fields {unknown}; this endpoint takes {sorted(spec)}")
    values = {}
    for field, (types, default) in spec.items():
        if field not in body:
            if default is _REQUIRED:
                raise InvalidRequest(f"field {field!r} is required")
            values[field] = default
            continue
        value = body[field]
        allowed = types if isinstance(types, tuple) else (types,)
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise InvalidRequest(f"field {field!r} must be {names}, got {type(value).__name__}")
        values[field] = value
    return values
