"""Rollout engine that talks to SGLang servers (or the CPU server standing in for them) over native HTTP,
optionally through an ``sglang-router`` for ``/generate``.

One HTTP request per sample, so a failure costs one sample, not a group. Requests run on a bounded thread pool;
each has a timeout, and a transient failure (connection error, timeout, HTTP 429/5xx, an aborted generation) puts
that server on cooldown and retries the sample on the next server with exponential backoff. Every (group, index)
slot is filled exactly once: a retry happens only when the previous attempt returned nothing usable.

A reply that is malformed (bad JSON, missing fields, wrong-length logprobs, a routed_experts payload of the wrong
size) or an HTTP 4xx is not retried: it means a misconfiguration, and raises :class:`RolloutError` naming the
server, the request id and the field.

Topology (see :mod:`topology`): ``urls`` are the workers; ``router_url``, when given, receives ``/generate`` (it
balances the load itself); weight updates, cache flushes and health checks go to every worker. When the router
fails, generation fails over to the workers directly.

Weights: a worker is used only while it holds the current weights. A weight update is one or more calls
(``update_weights_from_disk``, ``update_weights_from_tensors`` per bucket, ``update_weights_from_distributed`` per
bucket) followed by :meth:`finish_weight_update`, which makes the workers that acknowledged every call the current
ones; a worker that missed a call is left out until a later update reaches it (metric ``rollout/stale_servers``).
The router cannot be told to skip a stale worker, so from then on generation bypasses it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import httpx
import torch

from sapo_megatron.data.vision import collapse_image_pads
from sapo_megatron.rollout.base import RolloutEngine, RolloutError, normalize_response_starts
from sapo_megatron.rollout.protocol import (
    generate_payload,
    parse_generate_reply,
    parse_score_reply,
    png_data_uri,
    score_payload,
)
from sapo_megatron.rollout.sglang.memory import (
    MEMORY_TAGS,
    MemoryState,
    MemoryStateError,
    normalize_tags,
)
from sapo_megatron.rollout.sglang.topology import auth_headers
from sapo_megatron.rollout.tensor_transport import (
    FLATTENED_BUCKET,
    flattened_buckets,
    serialize_flattened_bucket,
)
from sapo_megatron.rollout.types import GenerationRequest, ImageInputs, Sample, mask_image_targets
from sapo_megatron.runtime.interrupts import wait_for

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _Transient(Exception):
    """A failure that another attempt (possibly on another server) may not have."""


class _Cancelled(Exception):
    """Another sample of the same call failed for good; stop early."""


@dataclasses.dataclass(eq=False)
class _Server:
    url: str
    cooldown_until: float = 0.0
    weight_version: int = 0
    tp_size: int = 1
    memory: MemoryState = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.memory = MemoryState(self.url)


class SGLangClient(RolloutEngine):
    """Rollout engine over SGLang's native HTTP API.

    Args:
        urls: the worker URLs, e.g. ``http://10.0.0.1:30000``.
        router_url: an ``sglang-router`` in front of the workers, used for ``/generate`` (and scoring) only.
        api_key: sent as ``Authorization: Bearer <key>`` (SGLang's and sglang-router's ``--api-key``).
        num_layers / top_k: shape of ``routed_experts`` (``num_hidden_layers`` / ``num_experts_per_tok`` of the
            model); ``num_layers`` is required to request routed experts, ``top_k`` is inferred when None.
        vocab_size: the trainer's vocabulary; a reply with an output id outside it is a ``RolloutError`` naming the
            server (None: not checked).
        max_concurrency: HTTP requests in flight at once.
        timeout_s: per-request timeout (one sample's generation).
        max_retries: further attempts per sample after the first.
        backoff_s / max_backoff_s: exponential backoff between attempts (with jitter).
        cooldown_s: how long a failed server is skipped while others are available.
        weight_sync_timeout_s: timeout of the weight-sync calls.
        tp_size: tensor-parallel size of every worker, or one size per worker (``update_weights_from_tensors``
            sends one payload per rank; ``init_weights_update_group`` gives each rank its place in the group).
        serializer: turns a list of (name, tensor) into the base64 string SGLang deserializes; default: CPU
            tensors as named shared-memory files (servers on this machine), CUDA tensors through SGLang's
            ``MultiprocessingSerializer`` (needs ``sglang`` installed, colocated GPUs only).
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        router_url: str | None = None,
        api_key: str | None = None,
        num_layers: int | None = None,
        top_k: int | None = None,
        vocab_size: int | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        cooldown_s: float = 30.0,
        weight_sync_timeout_s: float = 1800.0,
        tp_size: int | Sequence[int] = 1,
        serializer: Callable[[list[tuple[str, torch.Tensor]]], str] | None = None,
        flatten_buckets: bool = False,
    ) -> None:
        url_list = [urls] if isinstance(urls, str) else list(urls)
        if not url_list:
            raise ValueError("SGLangClient needs at least one server URL")
        tp_sizes = [tp_size] * len(url_list) if isinstance(tp_size, int) else [int(t) for t in tp_size]
        if len(tp_sizes) != len(url_list) or min(tp_sizes) < 1:
            raise ValueError(f"SGLangClient: tp_size {tp_size!r} must be >= 1 (one value or one per worker)")
        if max_concurrency < 1 or max_retries < 0:
            raise ValueError("SGLangClient: max_concurrency must be >= 1, max_retries >= 0")
        self._servers = [_Server(url.rstrip("/"), tp_size=t) for url, t in zip(url_list, tp_sizes)]
        self._router = _Server(router_url.rstrip("/")) if router_url else None
        self._router_usable = self._router is not None
        self._acknowledged: set[str] | None = (
            None  # workers that acknowledged every call of the current update
        )
        self.num_layers = num_layers
        self.top_k = top_k
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.cooldown_s = cooldown_s
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self._serializer = serializer
        self.flatten_buckets = flatten_buckets
        self._weight_version = 0
        self._sessions: set[str] = set()  # workers with an open SGLang weight-update session (begin/end)
        self._lock = threading.Lock()
        self._round_robin = itertools.count()
        self._busy = 0  # generate / score calls of this client in flight (a release must wait for them)
        self._counters = dict.fromkeys(
            (
                "rollout/requests",
                "rollout/retries",
                "rollout/failovers",
                "rollout/transient_errors",
                "rollout/aborted_samples",
                "rollout/samples",
                "rollout/generated_tokens",
                "rollout/stale_servers",
            ),
            0.0,
        )
        self._http = httpx.Client(
            headers=auth_headers(api_key),
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            # SGLang (uvicorn) and the CPU server close idle connections after 5 s: close ours first, never race
            limits=httpx.Limits(
                max_connections=max_concurrency,
                max_keepalive_connections=max_concurrency,
                keepalive_expiry=4.0,
            ),
        )
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="sglang-client")

    @property
    def urls(self) -> list[str]:
        """The workers."""
        return [s.url for s in self._servers]

    @property
    def router_url(self) -> str | None:
        """The router that ``/generate`` goes to, or None (no router, or bypassed after a partial update)."""
        return self._router.url if self._router is not None and self._router_usable else None

    # ------------------------------------------------------------------ generation
    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        for req in requests:
            if req.return_routed_experts and self.num_layers is None:
                raise ValueError(
                    "return_routed_experts needs SGLangClient(num_layers=...) to shape the payload"
                )
        self._require_memory(MEMORY_TAGS, "generate")
        call_id = uuid.uuid4().hex[:12]
        slots: list[list[Sample | None]] = [[None] * req.n for req in requests]

        def run(req_index: int, sample_index: int, cancel: threading.Event) -> None:
            req = requests[req_index]
            sample = self._generate_one(
                req, sample_index, f"{call_id}-g{req.group_id}-s{sample_index}", cancel
            )
            if slots[req_index][sample_index] is not None:
                raise AssertionError(f"sample {sample_index} of group {req.group_id} produced twice")
            slots[req_index][sample_index] = sample

        tasks = [(run, (r, i)) for r, req in enumerate(requests) for i in range(req.n)]
        self._run_all(tasks)
        missing = [
            (requests[r].group_id, i)
            for r, group in enumerate(slots)
            for i, s in enumerate(group)
            if s is None
        ]
        if missing:
            raise AssertionError(f"samples never produced: {missing[:5]}")
        return [[s for s in group if s is not None] for group in slots]

    def _generate_one(
        self, req: GenerationRequest, index: int, rid_base: str, cancel: threading.Event
    ) -> Sample:
        prompt_ids, image_data = _wire_prompt(req)

        def attempt(server: _Server, rid: str) -> Any:
            payload = generate_payload(
                prompt_ids,
                req.sampling,
                rid=rid,
                sample_index=index,
                return_routed_experts=req.return_routed_experts,
                routed_experts_start=req.routed_experts_start,
                image_data=image_data,
            )
            reply = self._post(server, "/generate", payload, request=rid)
            parsed = parse_generate_reply(
                reply,
                prompt_ids=req.prompt_ids,
                max_new_tokens=req.sampling.max_new_tokens,
                rid=rid,
                server=server.url,
                want_routed_experts=req.return_routed_experts,
                num_layers=self.num_layers,
                top_k=self.top_k,
                vocab_size=self.vocab_size,
                routed_experts_start=req.routed_experts_start,
                images=len(image_data or ()),
            )
            return parsed

        parsed = self._with_failover(rid_base, attempt, cancel, retry_if=lambda p: p.finish_reason == "abort")
        self._count("rollout/samples", 1)
        self._count("rollout/generated_tokens", len(parsed.response_ids))
        if parsed.finish_reason == "abort":
            self._count("rollout/aborted_samples", 1)
        return Sample(
            group_id=req.group_id,
            sample_index=index,
            prompt_ids=list(req.prompt_ids),
            response_ids=parsed.response_ids,
            rollout_logp=parsed.logprobs,
            finish_reason=parsed.finish_reason,
            routed_experts=parsed.routed_experts,
            routed_experts_start=req.routed_experts_start,
        )

    def score(
        self,
        token_ids_list: Sequence[Sequence[int]],
        response_start: int | Sequence[int],
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[list[float]]:
        starts = normalize_response_starts(token_ids_list, response_start)
        self._require_memory(MEMORY_TAGS, "score")
        images = list(images) if images is not None else [None] * len(token_ids_list)
        _check_image_pads(token_ids_list, images)
        call_id = uuid.uuid4().hex[:12]
        results: list[list[float] | None] = [None] * len(token_ids_list)

        def run(i: int, cancel: threading.Event) -> None:
            ids = list(token_ids_list[i])
            wire_ids, image_data = _wire_ids(ids, images[i])

            def attempt(server: _Server, rid: str) -> list[float]:
                payload = score_payload(wire_ids, rid=rid, image_data=image_data)
                reply = self._post(server, "/generate", payload, request=rid)
                return parse_score_reply(reply, token_ids=ids, rid=rid, server=server.url)

            values = self._with_failover(f"{call_id}-score{i}", attempt, cancel)
            # values[t - 1] is log p(ids[t] | ids[:t])
            results[i] = mask_image_targets(values[starts[i] - 1 :], ids[starts[i] :], images[i])

        self._run_all([(run, (i,)) for i in range(len(token_ids_list))])
        return [r for r in results if r is not None]

    def _run_all(self, tasks: list[tuple[Callable[..., None], tuple]]) -> None:
        """Run tasks on the pool; on the first lasting failure cancel the rest and raise it."""
        cancel = threading.Event()
        with self._lock:
            self._busy += 1
        try:
            pending = {self._pool.submit(fn, *args, cancel) for fn, args in tasks}
            errors: list[BaseException] = []
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    exc = future.exception()
                    if exc is not None and not isinstance(exc, _Cancelled):
                        cancel.set()
                        errors.append(exc)
        finally:
            with self._lock:
                self._busy -= 1
        if errors:
            raise errors[0]

    def _with_failover(
        self,
        rid_base: str,
        attempt: Callable[[_Server, str], T],
        cancel: threading.Event,
        retry_if: Callable[[T], bool] | None = None,
    ) -> T:
        last_server: _Server | None = None
        last_error: Exception | None = None
        result: T | None = None
        for attempt_index in range(self.max_retries + 1):
            if cancel.is_set():
                raise _Cancelled
            server = self._pick_server(avoid=last_server)
            if attempt_index:
                self._count("rollout/retries", 1)
                if last_server is not None and server is not last_server:
                    self._count("rollout/failovers", 1)
            rid = f"{rid_base}-a{attempt_index}"
            self._count("rollout/requests", 1)
            try:
                result = attempt(server, rid)
            except _Transient as exc:
                last_error = exc
                self._count("rollout/transient_errors", 1)
                self._cool_down(server)
                logger.warning("attempt %d of %s on %s failed: %s", attempt_index, rid_base, server.url, exc)
            else:
                if retry_if is None or not retry_if(result):
                    return result
                last_error = None
                logger.warning(
                    "attempt %d of %s on %s was aborted by the server", attempt_index, rid_base, server.url
                )
            last_server = server
            if attempt_index < self.max_retries:
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt_index) * random.uniform(0.5, 1.0)
                cancel.wait(delay)
        if last_error is None and result is not None:
            return result  # still aborted after every retry: the caller sees finish_reason "abort"
        raise RolloutError(
            f"request failed on {self.max_retries + 1} attempts, last error: {last_error}",
            server=last_server.url if last_server else None,
            request=rid_base,
            field="transport",
        ) from last_error

    def _pick_server(self, avoid: _Server | None) -> _Server:
        """The router when usable and not cooling down; else round-robin over workers with the current weights,
        skipping those on cooldown while others remain."""
        with self._lock:
            current = [s for s in self._servers if s.weight_version == self._weight_version]
            if not current:
                raise RolloutError("no worker holds the current weights; run a weight update again")
            now = time.monotonic()
            router = self._router if self._router_usable else None
            if router is not None and router is not avoid and router.cooldown_until <= now:
                return router
            start = next(self._round_robin) % len(current)
            ordered = current[start:] + current[:start]
            ready = [s for s in ordered if s.cooldown_until <= now]
            preferred = [s for s in ready if s is not avoid] or ready
            if preferred:
                return preferred[0]
            # All are cooling down: take the one that recovers first rather than fail.
            return min(ordered, key=lambda s: s.cooldown_until)

    def _cool_down(self, server: _Server) -> None:
        with self._lock:
            server.cooldown_until = time.monotonic() + self.cooldown_s

    # ------------------------------------------------------------------ HTTP
    def _post(
        self,
        server: _Server,
        path: str,
        payload: dict[str, Any],
        *,
        request: str,
        timeout: float | None = None,
    ) -> Any:
        return self._request("POST", server, path, payload, request=request, timeout=timeout)

    def _request(
        self,
        method: str,
        server: _Server,
        path: str,
        payload: dict[str, Any] | None,
        *,
        request: str,
        timeout: float | None = None,
        expect_json: bool = True,
    ) -> Any:
        url = server.url + path
        try:
            response = self._http.request(
                method, url, json=payload, timeout=timeout or httpx.USE_CLIENT_DEFAULT
            )
        except httpx.TransportError as exc:
            raise _Transient(f"{type(exc).__name__}: {exc}") from exc
        status = response.status_code
        if status == 429 or status >= 500:
            raise _Transient(f"HTTP {status} from {path}: {response.text[:300]}")
        if status >= 400:
            raise RolloutError(
                f"HTTP {status} from {path}: {_error_message(response)}",
                server=server.url,
                request=request,
                field="<status>",
            )
        if not expect_json:
            return response.text
        try:
            return response.json()
        except ValueError as exc:
            raise RolloutError(
                f"reply of {path} is not valid JSON ({exc}): {response.text[:200]!r}",
                server=server.url,
                request=request,
                field="<body>",
            ) from exc

    def _for_each_server(
        self, servers: list[_Server], fn: Callable[[_Server], T], *, interruptible: bool = False
    ) -> list[T | Exception]:
        """Run ``fn`` on every server in parallel; results or the exceptions raised, in server order.
        ``interruptible``: a stop signal ends the wait (weight updates; see ``interrupts.wait_for``)."""

        def guarded(server: _Server) -> T | Exception:
            try:
                return fn(server)
            except Exception as exc:
                return exc

        if interruptible:
            return self._wait_all([functools.partial(guarded, server) for server in servers])
        return list(self._pool.map(guarded, servers))

    def _wait_all(self, calls: list[Callable[[], T]]) -> list[T]:
        """Run each call on its own daemon thread; their results, waiting so that a stop signal ends the wait
        (``WaitInterrupted``) and leaves no thread that the exit or :meth:`close` would wait for."""
        futures = [self._background(call) for call in calls]
        wait_for(futures, "waiting for the rollout servers")
        return [future.result() for future in futures]

    # ------------------------------------------------------------------ weights and housekeeping
    def update_weights_from_disk(self, path: str, *, flush_cache: bool = True) -> None:
        """``POST /update_weights_from_disk {model_path}`` on every worker, then finish the update (flush caches).

        ``path`` must be absolute and readable by every worker (a shared filesystem on a cluster)."""
        self._require_memory(("weights",), "update_weights_from_disk")
        if not path.startswith("/"):
            raise ValueError(
                f"update_weights_from_disk needs an absolute path the servers can read, got {path!r}"
            )

        def load(server: _Server) -> None:
            reply = self._post(
                server,
                "/update_weights_from_disk",
                {"model_path": path},
                request="update_weights_from_disk",
                timeout=self.weight_sync_timeout_s,
            )
            self._check_success(reply, server, "update_weights_from_disk")

        self._update_each_worker(load, f"update_weights_from_disk({path})")
        self.finish_weight_update(flush_cache=flush_cache)

    def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``POST /update_weights_from_tensor`` with one bucket of serialized tensors, one payload per TP rank of
        each worker (call :meth:`finish_weight_update` after the last bucket).

        The payload holds handles, not data: CUDA IPC handles (servers colocated on the trainer's GPUs) or, for CPU
        tensors, named shared-memory files (servers on this machine, e.g. real SGLang on CPU). With
        ``flatten_buckets`` the bucket goes as one flattened tensor per dtype (SGLang's ``flattened_bucket``)."""
        self._require_memory(("weights",), "update_weights_from_tensors")
        named = [(name, tensor) for name, tensor in named_tensors]  # alive until every worker has replied
        if self.flatten_buckets:
            for bucket in flattened_buckets(
                named
            ):  # one POST per dtype, each a fresh buffer kept until replied
                self._post_tensors(_flat_serializer(bucket), FLATTENED_BUCKET)
                del bucket
        else:
            self._post_tensors((self._serializer or _engine_serializer())(named), None)
        del named

    def _post_tensors(self, blob: str, load_format: str | None) -> None:
        def load(server: _Server) -> None:
            self._begin_session(server)
            payload = {
                "serialized_named_tensors": [blob] * server.tp_size,
                "load_format": load_format,
                "flush_cache": False,
            }
            reply = self._post(
                server,
                "/update_weights_from_tensor",
                payload,
                request="update_weights_from_tensor",
                timeout=self.weight_sync_timeout_s,
            )
            self._check_success(reply, server, "update_weights_from_tensor")

        self._update_each_worker(load, "update_weights_from_tensors")

    def weight_group_layout(self) -> tuple[int, list[int]]:
        """``(world_size, rank_offsets)`` of a weight-update group: the trainer is rank 0, worker ``i``'s TP ranks
        follow from ``rank_offsets[i]``."""
        offsets, next_rank = [], 1
        for server in self._servers:
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
    ) -> Future:
        """``POST /init_weights_update_group`` on every worker, in the background.

        The workers block until the trainer's rank joins the same group (rendezvous at
        ``master_address:master_port``, trainer rank 0, worker ``i`` taking ranks from ``rank_offsets[i]``): join,
        then wait on the returned future (:meth:`weight_group_layout` gives the sizes)."""
        if len(rank_offsets) != len(self._servers):
            raise ValueError(f"{len(rank_offsets)} rank_offsets for {len(self._servers)} servers")

        def join(server: _Server, offset: int) -> None:
            payload = {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            }
            reply = self._post(
                server,
                "/init_weights_update_group",
                payload,
                request="init_weights_update_group",
                timeout=self.weight_sync_timeout_s,
            )
            self._check_success(reply, server, "init_weights_update_group")

        return self._background(lambda: self._all_or_raise(list(zip(self._servers, rank_offsets)), join))

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
    ) -> Future:
        """``POST /update_weights_from_distributed`` (one bucket's tensor metadata) on every worker of the group,
        in the background. The workers then receive each tensor by broadcast from the trainer (group rank 0):
        broadcast them in this order, then wait on the returned future; :meth:`finish_weight_update` after the
        last bucket. A worker that fails here breaks the group: the error is raised, never skipped."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        self._require_memory(("weights",), "update_weights_from_distributed")
        payload = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": False,
        }

        def load(server: _Server) -> None:
            self._begin_session(server)
            reply = self._post(
                server,
                "/update_weights_from_distributed",
                payload,
                request="update_weights_from_distributed",
                timeout=self.weight_sync_timeout_s,
            )
            self._check_success(reply, server, "update_weights_from_distributed")

        def run() -> None:
            self._all_or_raise([(s,) for s in self._servers], load)
            self._acknowledge(self._servers)

        return self._background(run)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """``POST /destroy_weights_update_group`` on every worker (after a failed broadcast, or at the end)."""

        def destroy(server: _Server) -> None:
            reply = self._post(
                server,
                "/destroy_weights_update_group",
                {"group_name": group_name},
                request="destroy_weights_update_group",
                timeout=60.0,
            )
            self._check_success(reply, server, "destroy_weights_update_group")

        self._all_or_raise([(s,) for s in self._servers], destroy)

    def finish_weight_update(self, *, flush_cache: bool = True) -> None:
        """End a weight update: the workers that acknowledged every call since the last update hold the new
        weights and are the only ones used from now on; then ``POST /flush_cache`` on them."""
        with self._lock:
            acknowledged = self._acknowledged or set()
            self._acknowledged = None
            updated = [s for s in self._servers if s.url in acknowledged]
            if not updated:
                raise RolloutError("weight update: no worker acknowledged it", field="transport")
            self._weight_version += 1
            for server in updated:
                server.weight_version = self._weight_version
                server.cooldown_until = 0.0
            stale = [s.url for s in self._servers if s.weight_version != self._weight_version]
            self._counters["rollout/stale_servers"] = float(len(stale))
            bypass_router = bool(stale) and self._router_usable
            if bypass_router:
                self._router_usable = False
        self._end_sessions(updated)
        if stale:
            logger.warning("weight update: unreachable workers keep old weights and are left out: %s", stale)
        if bypass_router:
            logger.warning("the router would still send requests to them: generating on the workers directly")
        if flush_cache:
            self.flush_cache()

    def flush_cache(self) -> None:
        """``POST /flush_cache`` on every server with the current weights (unreachable ones are cooled down)."""
        with self._lock:
            servers = [s for s in self._servers if s.weight_version == self._weight_version]
        outcomes = self._for_each_server(
            servers,
            lambda s: self._request(
                "POST", s, "/flush_cache", None, request="flush_cache", expect_json=False
            ),
        )
        for server, outcome in zip(servers, outcomes):
            if isinstance(outcome, _Transient):
                self._cool_down(server)
                logger.warning("flush_cache on %s failed: %s", server.url, outcome)
            elif isinstance(outcome, Exception):
                raise outcome

    # ------------------------------------------------------------------ memory (colocation, see memory.py)
    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """``POST /release_memory_occupation {tags}`` on every worker (None or ``[]``: all of ``MEMORY_TAGS``).

        Refused before anything is sent (:class:`MemoryStateError`) while this client's requests run, when a
        worker reports requests of others (``/flush_cache`` answers 400 unless idle: the idle probe), or when a tag
        is already released: SGLang's scheduler asserts idleness and dies otherwise."""
        chosen = normalize_tags(tags)
        with self._lock:
            busy = self._busy
        for server in self._servers:
            server.memory.check_release(chosen, busy)
        self._probe_idle(chosen)
        self._memory_call("/release_memory_occupation", chosen, lambda s: s.memory.released.update(chosen))

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """``POST /resume_memory_occupation {tags}`` on every worker; refused for a tag that is not released
        (SGLang's scheduler raises ``KeyError`` and dies)."""
        chosen = normalize_tags(tags)
        for server in self._servers:
            server.memory.check_resume(chosen)
        self._memory_call(
            "/resume_memory_occupation", chosen, lambda s: s.memory.released.difference_update(chosen)
        )

    def released_memory(self) -> dict[str, list[str]]:
        """Per worker, the tags it holds released (in ``MEMORY_TAGS`` order)."""
        return {s.url: [t for t in MEMORY_TAGS if t in s.memory.released] for s in self._servers}

    def _memory_call(self, path: str, tags: tuple[str, ...], on_success: Callable[[_Server], None]) -> None:
        def call(server: _Server) -> None:
            self._post(
                server, path, {"tags": list(tags)}, request=path[1:], timeout=self.weight_sync_timeout_s
            )
            on_success(server)  # SGLang answers 200 with the body null

        outcomes = self._for_each_server(self._servers, call)
        for server, outcome in zip(self._servers, outcomes):
            if isinstance(outcome, _Transient):
                raise RolloutError(
                    f"{path[1:]}: unreachable: {outcome}", server=server.url, field="transport"
                )
            if isinstance(outcome, Exception):
                raise outcome

    def _probe_idle(self, tags: tuple[str, ...]) -> None:
        """``POST /flush_cache`` on every worker: SGLang answers 400 ("Flush cache failed") while any request
        runs or waits, also another client's, which this client cannot count."""

        def probe(server: _Server) -> None:
            self._request("POST", server, "/flush_cache", None, request="flush_cache", expect_json=False)

        for server, outcome in zip(self._servers, self._for_each_server(self._servers, probe)):
            if isinstance(outcome, RolloutError) and outcome.field == "<status>":
                raise MemoryStateError(
                    f"release_memory_occupation({list(tags)}): the server is not idle (/flush_cache refused: "
                    f"{outcome}); SGLang would go down",
                    server=server.url,
                    field="tags",
                ) from outcome
            if isinstance(outcome, Exception):
                raise RolloutError(
                    f"idle probe before releasing memory failed: {outcome}",
                    server=server.url,
                    field="transport",
                ) from outcome

    # ------------------------------------------------------------------ weight checks (see weight_checksum)
    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """``POST /weights_checker {"action": "checksum"}`` on every worker: per worker, ``{served name: hex}``.
        Only TP-1 workers: a TP rank holds shards, which the trainer's export cannot be hashed into."""
        wide = [s.url for s in self._servers if s.tp_size != 1]
        if wide:
            raise RolloutError(
                "weight checks compare whole tensors and need TP-1 servers; turn rollout.colocate.check_weights "
                f"off for {wide}",
                server=wide[0],
                field="tp_size",
            )

        def checksum(server: _Server) -> dict[str, str]:
            reply = self._post(
                server,
                "/weights_checker",
                {"action": "checksum"},
                request="weights_checker",
                timeout=self.weight_sync_timeout_s,
            )
            self._check_success(reply, server, "weights_checker")
            ranks = reply.get("ranks")
            if (
                not isinstance(ranks, list)
                or len(ranks) != 1
                or not isinstance(ranks[0].get("checksums"), dict)
            ):
                raise RolloutError(
                    "weights_checker: expected one rank with checksums", server=server.url, field="ranks"
                )
            return {str(k): str(v) for k, v in ranks[0]["checksums"].items()}

        outcomes = self._for_each_server(self._servers, checksum)
        for server, outcome in zip(self._servers, outcomes):
            if isinstance(outcome, Exception):
                raise RolloutError(
                    f"weights_checker: {outcome}", server=server.url, field="transport"
                ) from outcome
        return {s.url: o for s, o in zip(self._servers, outcomes)}  # type: ignore[misc]

    def _require_memory(self, tags: Sequence[str], what: str) -> None:
        for server in self._servers:
            server.memory.require(tags, what)

    def health(self) -> bool:
        """True when every server answers ``GET /health`` with 200."""
        return all(self.server_health().values())

    def server_health(self) -> dict[str, bool]:
        def probe(server: _Server) -> bool:
            self._request("GET", server, "/health", None, request="health", timeout=10.0, expect_json=False)
            return True

        outcomes = self._for_each_server(self._servers, probe)
        return {s.url: outcome is True for s, outcome in zip(self._servers, outcomes)}

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()

    # ------------------------------------------------------------------ weight-update sessions
    # SGLang 0.5.23 refuses update_weights_from_distributed / _from_tensor outside a session
    # (srt/managers/scheduler_components/weight_updater.py: "must run between begin_weight_update() and
    # end_weight_update()"): POST /begin_weight_update before a worker's first call of an update, POST
    # /end_weight_update when the update finishes. Servers without these endpoints (older SGLang, the CPU stand-in)
    # answer 404 and need no session.
    def _begin_session(self, server: _Server) -> None:
        with self._lock:
            if server.url in self._sessions:
                return
        reply = self._session_call(server, "/begin_weight_update")
        if reply is not None and reply.get("success") is not True:
            message = str(reply.get("message", ""))
            if "already open" not in message:  # left open by an update that failed midway: keep using it
                raise RolloutError(
                    f"begin_weight_update failed: {message}", server=server.url, field="success"
                )
        with self._lock:
            self._sessions.add(server.url)

    def _end_sessions(self, servers: Sequence[_Server]) -> None:
        with self._lock:
            open_on = [s for s in servers if s.url in self._sessions]
            self._sessions.difference_update(s.url for s in servers)
        for outcome in self._for_each_server(open_on, self._end_session):
            if isinstance(outcome, Exception):
                raise outcome

    def _end_session(self, server: _Server) -> None:
        reply = self._session_call(server, "/end_weight_update")
        if reply is not None and reply.get("success") is not True:
            raise RolloutError(
                f"end_weight_update failed: {reply.get('message')}", server=server.url, field="success"
            )

    def _session_call(self, server: _Server, path: str) -> dict[str, Any] | None:
        """The reply of ``path`` (200 or 400 with ``success``), or None when the server has no such endpoint."""
        try:
            response = self._http.post(server.url + path, json={}, timeout=self.weight_sync_timeout_s)
        except httpx.TransportError as exc:
            raise _Transient(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code == 404:
            return None
        if response.status_code not in (200, 400):
            raise RolloutError(
                f"HTTP {response.status_code} from {path}: {_error_message(response)}",
                server=server.url,
                request=path.lstrip("/"),
                field="<status>",
            )
        try:
            reply = response.json()
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise RolloutError(f"reply of {path} is not a JSON object", server=server.url, field="<body>")
        return reply

    # ------------------------------------------------------------------ helpers
    def _update_each_worker(self, load: Callable[[_Server], None], what: str) -> None:
        """Run one call of a weight update on every worker; remember which acknowledged it."""
        outcomes = self._for_each_server(self._servers, load, interruptible=True)
        for outcome in outcomes:
            if isinstance(outcome, Exception) and not isinstance(outcome, _Transient):
                raise outcome  # the server answered and refused: the checkpoint or the request is wrong
        updated = [s for s, outcome in zip(self._servers, outcomes) if not isinstance(outcome, Exception)]
        if not updated:
            raise RolloutError(
                f"{what}: no worker was reachable: {outcomes[0]}",
                server=self._servers[0].url,
                field="transport",
            )
        self._acknowledge(updated)

    def _acknowledge(self, servers: Sequence[_Server]) -> None:
        with self._lock:
            urls = {s.url for s in servers}
            self._acknowledged = urls if self._acknowledged is None else self._acknowledged & urls

    def _all_or_raise(self, arg_tuples: list[tuple], fn: Callable[..., None]) -> None:
        outcomes = self._wait_all([functools.partial(_capture, fn, *args) for args in arg_tuples])
        for args, outcome in zip(arg_tuples, outcomes):
            if isinstance(outcome, _Transient):
                raise RolloutError(
                    f"unreachable: {outcome}", server=args[0].url, field="transport"
                ) from outcome
            if isinstance(outcome, Exception):
                raise outcome

    def _background(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()

        def runner() -> None:
            try:
                result = fn()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

        threading.Thread(target=runner, name="sglang-client-weight-sync", daemon=True).start()
        return future

    @staticmethod
    def _check_success(reply: Any, server: _Server, what: str) -> None:
        if not isinstance(reply, dict) or reply.get("success") is not True:
            message = reply.get("message") if isinstance(reply, dict) else reply
            raise RolloutError(f"{what} failed: {message}", server=server.url, request=what, field="success")

    def _count(self, key: str, value: float) -> None:
        with self._lock:
            self._counters[key] += value


def _wire_prompt(req: GenerationRequest) -> tuple[list[int], list[str] | None]:
    """The ids and images a request is sent with: with images, one pad per image and PNG data URIs (SGLang expands
    the pads with its own processor; its ``prompt_tokens`` must then equal the trainer's expanded prompt)."""
    return _wire_ids(req.prompt_ids, req.images)


def _check_image_pads(token_ids_list: Sequence[Sequence[int]], images: Sequence[ImageInputs | None]) -> None:
    """One run of image pads per image, before anything is sent: SGLang takes every pad id of ``input_ids`` for an
    image placeholder (more pads than images: HTTP 500 from ``base_processor.build_input_ids``)."""
    for i, (ids, image) in enumerate(zip(token_ids_list, images, strict=True)):
        if image is None:
            continue
        runs = collapse_image_pads(ids, image.pad_id).count(image.pad_id)
        if runs != len(image.png):
            raise RolloutError(
                f"score: sequence {i} holds {runs} runs of the image-pad token {image.pad_id} for "
                f"{len(image.png)} images; SGLang would take each for an image (a sampled <|image_pad|> cannot be "
                "scored: score up to it)",
                field="input_ids",
            )


def _wire_ids(ids: Sequence[int], images: ImageInputs | None) -> tuple[list[int], list[str] | None]:
    if images is None:
        return list(ids), None
    return collapse_image_pads(ids, images.pad_id), [png_data_uri(png) for png in images.png]


def _capture(fn: Callable[..., None], *args: Any) -> Exception | None:
    try:
        fn(*args)
    except Exception as exc:
        return exc
    return None


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:300]


def _flat_serializer(bucket: dict[str, Any]) -> str:
    """A flattened bucket for a separate process: shared-memory file names (CPU), SGLang's serializer (CUDA)."""
    if bucket["flattened_tensor"].device.type == "cpu":
        return serialize_flattened_bucket(bucket, sharing="file_system")
    from sglang.srt.utils import MultiprocessingSerializer  # CUDA tensors: colocated GPUs, SGLang installed

    return MultiprocessingSerializer.serialize(bucket, output_str=True)


def _engine_serializer() -> Callable[[list[tuple[str, torch.Tensor]]], str]:
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
