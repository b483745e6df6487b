"""The control plane of the SGLang workers: weight updates in all three transports, SGLang's weight-update
sessions, cache flushes, memory release / resume (colocation) and weight checksums. Every call goes to every
worker, never to the router.

Weights: a worker is used only while it holds the current weights. A weight update is one or more calls
(``update_weights_from_disk``, ``update_weights_from_tensors`` per bucket, ``update_weights_from_distributed`` per
bucket) followed by :meth:`ControlPlane.finish_weight_update`, which makes the workers that acknowledged every call
the current ones; a worker that missed a call (unreachable: a transient error, see :mod:`.errors`) is left out until
a later update reaches it (metric ``rollout/stale_servers``). A worker that answers and refuses fails the update.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from sapo_megatron.rollout.base import RolloutError
from sapo_megatron.rollout.partial import PAUSE_MODES
from sapo_megatron.rollout.sglang.errors import MalformedReply, OnTransient, Refused, check_status
from sapo_megatron.rollout.sglang.fleet import Fleet, Server
from sapo_megatron.rollout.sglang.memory import MEMORY_TAGS, MemoryStateError, normalize_tags
from sapo_megatron.rollout.tensor_transport import (
    FLATTENED_BUCKET,
    flattened_buckets,
    serialize_flattened_bucket,
)

logger = logging.getLogger(__name__)

Serializer = Callable[[list[tuple[str, torch.Tensor]]], str]


class ControlPlane:
    """Weight updates, cache flushes, memory and checksums of a fleet's workers (the arguments are those of
    :class:`~sapo_megatron.rollout.sglang.client.SGLangClient`)."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        weight_sync_timeout_s: float,
        serializer: Serializer | None,
        flatten_buckets: bool,
    ) -> None:
        self.fleet = fleet
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.serializer = serializer
        self.flatten_buckets = flatten_buckets
        self.sessions = UpdateSessions(fleet, weight_sync_timeout_s)
        self._acknowledged: set[str] | None = (
            None  # workers that acknowledged every call of the current update
        )

    # ------------------------------------------------------------------ the three transports
    def update_weights_from_disk(self, path: str, *, flush_cache: bool = True) -> None:
        """``POST /update_weights_from_disk {model_path}`` on every worker, then finish the update (flush caches).

        ``path`` must be absolute and readable by every worker (a shared filesystem on a cluster)."""
        self.fleet.require_memory(("weights",), "update_weights_from_disk")
        if not path.startswith("/"):
            raise ValueError(
                f"update_weights_from_disk needs an absolute path the servers can read, got {path!r}"
            )
        self._update_each_worker(
            lambda server: self._call(
                server,
                "/update_weights_from_disk",
                # flushed by finish_weight_update (SGLang's own flush fails the update while requests are held)
                {"model_path": path, "weight_version": self._next_label(), "flush_cache": False},
            ),
            f"update_weights_from_disk({path})",
        )
        self.finish_weight_update(flush_cache=flush_cache)

    def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``POST /update_weights_from_tensor`` with one bucket of serialized tensors, one payload per TP rank of
        each worker (call :meth:`finish_weight_update` after the last bucket).

        The payload holds handles, not data: CUDA IPC handles (servers colocated on the trainer's GPUs) or, for CPU
        tensors, named shared-memory files (servers on this machine, e.g. real SGLang on CPU). With
        ``flatten_buckets`` the bucket goes as one flattened tensor per dtype (SGLang's ``flattened_bucket``)."""
        self.fleet.require_memory(("weights",), "update_weights_from_tensors")
        named = [(name, tensor) for name, tensor in named_tensors]  # alive until every worker has replied
        if self.flatten_buckets:
            for bucket in flattened_buckets(
                named
            ):  # one POST per dtype, each a fresh buffer kept until replied
                self._post_tensors(flat_serializer(bucket), FLATTENED_BUCKET)
                del bucket
        else:
            self._post_tensors((self.serializer or engine_serializer())(named), None)
        del named

    def _post_tensors(self, blob: str, load_format: str | None) -> None:
        def load(server: Server) -> None:
            self.sessions.begin(server)
            payload = {
                "serialized_named_tensors": [blob] * server.tp_size,
                "load_format": load_format,
                "flush_cache": False,
                "weight_version": self._next_label(),
            }
            self._call(server, "/update_weights_from_tensor", payload)

        self._update_each_worker(load, "update_weights_from_tensors")

    def weight_group_layout(self) -> tuple[int, list[int]]:
        """``(world_size, rank_offsets)`` of a weight-update group: the trainer is rank 0, worker ``i``'s TP ranks
        follow from ``rank_offsets[i]``."""
        offsets, next_rank = [], 1
        for server in self.fleet.servers:
            offsets.append(next_rank)
            next_rank += server.tp_size
        return next_rank, offsets

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offsets: Sequence[int],
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> Future[None]:
        """``POST /init_weights_update_group`` on every worker, in the background.

        The workers block until the trainer's rank joins the same group (rendezvous at
        ``master_address:master_port``, trainer rank 0, worker ``i`` taking ranks from ``rank_offsets[i]``): join,
        then wait on the returned future (:meth:`weight_group_layout` gives the sizes)."""
        servers = self.fleet.servers
        if len(rank_offsets) != len(servers):
            raise ValueError(f"{len(rank_offsets)} rank_offsets for {len(servers)} servers")
        offset_of = dict(zip(servers, rank_offsets))

        def join(server: Server) -> None:
            payload = {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": offset_of[server],
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            }
            self._call(server, "/init_weights_update_group", payload)

        return self.fleet.background(lambda: self._on_every_worker(join, "init_weights_update_group"))

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
    ) -> Future[None]:
        """``POST /update_weights_from_distributed`` (one bucket's tensor metadata) on every worker of the group,
        in the background. The workers then receive each tensor by broadcast from the trainer (group rank 0):
        broadcast them in this order, then wait on the returned future; :meth:`finish_weight_update` after the
        last bucket. A worker that fails here breaks the group: the error is raised, never skipped."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        self.fleet.require_memory(("weights",), "update_weights_from_distributed")
        payload = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": False,
            "weight_version": self._next_label(),
        }

        def load(server: Server) -> None:
            self.sessions.begin(server)
            self._call(server, "/update_weights_from_distributed", payload)

        def run() -> None:
            self._on_every_worker(load, "update_weights_from_distributed")
            self._acknowledge(self.fleet.servers)

        return self.fleet.background(run)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """``POST /destroy_weights_update_group`` on every worker (after a failed broadcast, or at the end)."""
        self._on_every_worker(
            lambda s: self._call(
                s, "/destroy_weights_update_group", {"group_name": group_name}, timeout=60.0
            ),
            "destroy_weights_update_group",
        )

    # ------------------------------------------------------------------ the end of an update
    def finish_weight_update(self, *, flush_cache: bool = True) -> None:
        """End a weight update: the workers that acknowledged every call since the last update hold the new
        weights and are the only ones used from now on; then ``POST /flush_cache`` on them."""
        with self.fleet.lock:
            acknowledged = self._acknowledged or set()
            self._acknowledged = None
        updated = [s for s in self.fleet.servers if s.url in acknowledged]
        if not updated:
            raise RolloutError("weight update: no worker acknowledged it", field="transport")
        stale, bypass_router = self.fleet.make_current(updated)
        self.sessions.end(updated)
        if stale:
            logger.warning("weight update: unreachable workers keep old weights and are left out: %s", stale)
        if bypass_router:
            logger.warning("the router would still send requests to them: generating on the workers directly")
        if (
            flush_cache and self.fleet.pause.mode != "in_place"
        ):  # SGLang refuses it with requests held in place
            self.flush_cache()

    # ------------------------------------------------------------------ pause / continue (see pausing.py)
    def pause_generation(self, mode: str = "in_place", *, timeout_s: float = 300.0) -> None:
        """``POST /pause_generation {mode}`` on every worker (abort | retract | in_place); weights may then be
        updated. A worker that does not answer within ``timeout_s`` or is unreachable fails the pause with one
        error naming it (:class:`~.errors.Unavailable`); a stop signal cuts the wait short."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation: mode {mode!r} is not one of {list(PAUSE_MODES)}")
        self.fleet.pause.begin(mode)
        self._on_every_worker(
            lambda s: self.fleet.request(
                "POST", s, "/pause_generation", {"mode": mode}, request="pause_generation", timeout=timeout_s
            ),
            f"pause_generation({mode})",
        )

    def continue_generation(self, *, timeout_s: float = 300.0) -> None:
        """``POST /continue_generation`` on every worker; requests held or cut short by the pause go on."""
        try:
            self._on_every_worker(
                lambda s: self.fleet.request(
                    "POST", s, "/continue_generation", {}, request="continue_generation", timeout=timeout_s
                ),
                "continue_generation",
            )
        finally:
            self.fleet.pause.end()  # a failed worker is named by the error; the others do go on

    def flush_cache(self) -> None:
        """``POST /flush_cache`` on every server with the current weights (unreachable ones are cooled down)."""
        self.fleet.call_each(
            lambda s: self.fleet.request(
                "POST", s, "/flush_cache", None, request="flush_cache", expect_json=False
            ),
            what="flush_cache",
            on_transient=OnTransient.COOL_DOWN,
            servers=self.fleet.current_workers(),
        )

    # ------------------------------------------------------------------ memory (colocation, see memory.py)
    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """``POST /release_memory_occupation {tags}`` on every worker (None or ``[]``: all of ``MEMORY_TAGS``).

        Refused before anything is sent (:class:`MemoryStateError`) while this client's requests run, when a
        worker reports requests of others (``/flush_cache`` answers 400 unless idle: the idle probe), or when a tag
        is already released: SGLang's scheduler asserts idleness and dies otherwise."""
        chosen = normalize_tags(tags)
        with self.fleet.lock:
            busy = self.fleet.busy
        for server in self.fleet.servers:
            server.memory.check_release(chosen, busy)
        self._probe_idle(chosen)
        self._memory_call("/release_memory_occupation", chosen, lambda s: s.memory.released.update(chosen))

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """``POST /resume_memory_occupation {tags}`` on every worker; refused for a tag that is not released
        (SGLang's scheduler raises ``KeyError`` and dies)."""
        chosen = normalize_tags(tags)
        for server in self.fleet.servers:
            server.memory.check_resume(chosen)
        self._memory_call(
            "/resume_memory_occupation", chosen, lambda s: s.memory.released.difference_update(chosen)
        )

    def released_memory(self) -> dict[str, list[str]]:
        """Per worker, the tags it holds released (in ``MEMORY_TAGS`` order)."""
        return {s.url: [t for t in MEMORY_TAGS if t in s.memory.released] for s in self.fleet.servers}

    def _memory_call(self, path: str, tags: tuple[str, ...], on_success: Callable[[Server], None]) -> None:
        def call(server: Server) -> None:
            self.fleet.request(
                "POST",
                server,
                path,
                {"tags": list(tags)},
                request=path[1:],
                timeout=self.weight_sync_timeout_s,
            )
            on_success(server)  # SGLang answers 200 with the body null

        self._on_every_worker(call, path[1:])

    def _probe_idle(self, tags: tuple[str, ...]) -> None:
        """``POST /flush_cache`` on every worker: SGLang answers 400 ("Flush cache failed") while any request
        runs or waits, also another client's, which this client cannot count."""

        def probe(server: Server) -> None:
            try:
                self.fleet.request(
                    "POST", server, "/flush_cache", None, request="flush_cache", expect_json=False
                )
            except Refused as exc:
                raise MemoryStateError(
                    f"release_memory_occupation({list(tags)}): the server is not idle (/flush_cache refused: "
                    f"{exc}); SGLang would go down",
                    server=server.url,
                    field="tags",
                ) from exc

        self._on_every_worker(probe, "idle probe before releasing memory")

    # ------------------------------------------------------------------ weight checks (see weight_checksum)
    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """``POST /weights_checker {"action": "checksum"}`` on every worker: per worker, ``{served name: hex}``.
        Only TP-1 workers: a TP rank holds shards, which the trainer's export cannot be hashed into."""
        wide = [s.url for s in self.fleet.servers if s.tp_size != 1]
        if wide:
            raise RolloutError(
                "weight checks compare whole tensors and need TP-1 servers; turn rollout.colocation.check_weights "
                f"off for {wide}",
                server=wide[0],
                field="tp_size",
            )

        def checksum(server: Server) -> dict[str, str]:
            reply = self._call(server, "/weights_checker", {"action": "checksum"})
            ranks = reply.get("ranks")
            if (
                not isinstance(ranks, list)
                or len(ranks) != 1
                or not isinstance(ranks[0].get("checksums"), dict)
            ):
                raise MalformedReply(
                    "weights_checker: expected one rank with checksums", server=server.url, field="ranks"
                )
            return {str(k): str(v) for k, v in ranks[0]["checksums"].items()}

        done = self.fleet.call_each(checksum, what="weights_checker", on_transient=OnTransient.RAISE)
        return {server.url: sums for server, sums in done}

    # ------------------------------------------------------------------ helpers
    def _next_label(self) -> str:
        """The ``weight_version`` label of the update in progress: the fleet's next version number. SGLang
        (0.5.23) records the label of each token's forward and replies with them (``meta_info.weight_versions``),
        which is how a request that spans an update gets per-token versions."""
        return str(self.fleet.weight_version + 1)

    def _call(
        self, server: Server, path: str, payload: dict[str, Any], *, timeout: float | None = None
    ) -> dict[str, Any]:
        """One control call whose reply must say ``"success": true`` (else :class:`Refused`)."""
        what = path[1:]
        reply = self.fleet.request(
            "POST", server, path, payload, request=what, timeout=timeout or self.weight_sync_timeout_s
        )
        check_success(reply, server, what)
        return reply

    def _update_each_worker(self, load: Callable[[Server], object], what: str) -> None:
        """Run one call of a weight update on every worker; remember which acknowledged it (an unreachable worker
        is left out; a refusal fails the update)."""
        done = self.fleet.call_each(load, what=what, on_transient=OnTransient.SKIP, interruptible=True)
        self._acknowledge([server for server, _ in done])

    def _on_every_worker(self, call: Callable[[Server], object], what: str) -> None:
        """``call`` on every worker; any failure fails it (an unreachable worker: :class:`~.errors.Unavailable`)."""
        self.fleet.call_each(call, what=what, on_transient=OnTransient.RAISE, interruptible=True)

    def _acknowledge(self, servers: Sequence[Server]) -> None:
        with self.fleet.lock:
            urls = {s.url for s in servers}
            self._acknowledged = urls if self._acknowledged is None else self._acknowledged & urls


class UpdateSessions:
    """SGLang's weight-update sessions, per worker.

    SGLang 0.5.23 refuses update_weights_from_distributed / _from_tensor outside a session
    (srt/managers/scheduler_components/weight_updater.py: "must run between begin_weight_update() and
    end_weight_update()"): ``POST /begin_weight_update`` before a worker's first call of an update,
    ``POST /end_weight_update`` when the update finishes. Servers without these endpoints (older SGLang, the CPU
    stand-in) answer 404 and need no session."""

    def __init__(self, fleet: Fleet, timeout_s: float) -> None:
        self.fleet = fleet
        self.timeout_s = timeout_s
        self._open: set[str] = set()  # workers with an open session
        self._lock = threading.Lock()

    def begin(self, server: Server) -> None:
        """Open a session on ``server`` unless one is open (one left open by an update that failed midway is
        used as it is)."""
        with self._lock:
            if server.url in self._open:
                return
        reply = self._call(server, "/begin_weight_update")
        if reply is not None and reply.get("success") is not True:
            message = str(reply.get("message", ""))
            if "already open" not in message:
                raise Refused(f"begin_weight_update failed: {message}", server=server.url, field="success")
        with self._lock:
            self._open.add(server.url)

    def end(self, servers: Sequence[Server]) -> None:
        """Close the sessions open on ``servers``."""
        with self._lock:
            open_on = [s for s in servers if s.url in self._open]
            self._open.difference_update(s.url for s in servers)
        self.fleet.call_each(
            self._end_one, what="end_weight_update", on_transient=OnTransient.RAISE, servers=open_on
        )

    def _end_one(self, server: Server) -> None:
        reply = self._call(server, "/end_weight_update")
        if reply is not None and reply.get("success") is not True:
            raise Refused(
                f"end_weight_update failed: {reply.get('message')}", server=server.url, field="success"
            )

    def _call(self, server: Server, path: str) -> dict[str, Any] | None:
        """The reply of ``path`` (200 or 400 with ``success``), or None when the server has no such endpoint."""
        request = path.lstrip("/")
        response = self.fleet.send("POST", server, path, {}, request=request, timeout=self.timeout_s)
        if response.status_code == 404:
            return None
        if response.status_code != 400:
            check_status(response, server=server.url, path=path, request=request)
        try:
            reply = response.json()
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise MalformedReply(f"reply of {path} is not a JSON object", server=server.url, field="<body>")
        return reply


def check_success(reply: Any, server: Server, what: str) -> None:
    """A control reply must say ``"success": true``; else :class:`Refused` with its message."""
    if not isinstance(reply, dict) or reply.get("success") is not True:
        message = reply.get("message") if isinstance(reply, dict) else reply
        raise Refused(f"{what} failed: {message}", server=server.url, request=what, field="success")


def flat_serializer(bucket: dict[str, Any]) -> str:
    """A flattened bucket for a separate process: shared-memory file names (CPU), SGLang's serializer (CUDA)."""
    if bucket["flattened_tensor"].device.type == "cpu":
        return serialize_flattened_bucket(bucket, sharing="file_system")
    from sglang.srt.utils import MultiprocessingSerializer  # CUDA tensors: colocated GPUs, SGLang installed

    return MultiprocessingSerializer.serialize(bucket, output_str=True)


def engine_serializer() -> Serializer:
    """What a separate SGLang process can open: CPU tensors as named shared-memory files (our serializer with
    ``file_system``: the default ``file_descriptor`` handles are refused by a process that is not the sender's
    ``multiprocessing`` child, and real SGLang 0.5.23's scheduler dies of them – measured on CPU,
    tests/sglang_real); CUDA tensors through SGLang's own ``MultiprocessingSerializer`` (CUDA IPC with its
    device-UUID patch)."""

    def serialize(named: list[tuple[str, torch.Tensor]]) -> str:
        if all(tensor.device.type == "cpu" for _, tensor in named):
            from sapo_megatron.rollout.tensor_transport import serialize_named_tensors

            return serialize_named_tensors(named, sharing="file_system")
        try:
            from sglang.srt.utils import MultiprocessingSerializer
        except ImportError as exc:
            raise RolloutError(
                "update_weights_from_tensors with CUDA tensors needs SGLang's MultiprocessingSerializer: install "
                "the GPU extra (pip install 'sapo-megatron[gpu]') and colocate the servers with the trainer; "
                "otherwise sync weights with update_weights_from_disk or the NCCL path"
            ) from exc
        return MultiprocessingSerializer.serialize(named, output_str=True)

    return serialize
