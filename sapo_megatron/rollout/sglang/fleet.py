"""The servers an :class:`~sapo_megatron.rollout.sglang.client.SGLangClient` talks to, and the one place that
decides what a failed call leads to.

A :class:`Fleet` holds the workers (each with its cooldown, the weight version it holds, its TP size and memory
state), the optional router, the HTTP connection pool, the thread pool and the client's counters. Every call goes
through :meth:`Fleet.request`, which turns a failure into a typed error (:mod:`.errors`); every call that can fail
on a server goes through :meth:`Fleet.with_failover` (one request, retried on the next server) or
:meth:`Fleet.call_each` (one request per worker), which apply :func:`~.errors.on_error`.

Picking a server: the router when usable and not cooling down; else round-robin over the workers with the current
weights, skipping those on cooldown while others remain. After a weight update that some worker missed, the router
is bypassed for good (it cannot be told to skip a stale worker).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import httpx

from sapo_megatron.rollout.base import RolloutError
from sapo_megatron.rollout.sglang.errors import (
    Cancelled,
    OnTransient,
    TransientError,
    Unavailable,
    Unreachable,
    check_status,
    json_reply,
    on_error,
    unavailable,
)
from sapo_megatron.rollout.sglang.memory import MemoryState
from sapo_megatron.rollout.sglang.pausing import PauseState
from sapo_megatron.rollout.sglang.topology import auth_headers
from sapo_megatron.runtime.interrupts import wait_for

logger = logging.getLogger(__name__)

T = TypeVar("T")

COUNTERS = (
    "rollout/requests",
    "rollout/retries",
    "rollout/failovers",
    "rollout/transient_errors",
    "rollout/aborted_samples",
    "rollout/samples",
    "rollout/generated_tokens",
    "rollout/stale_servers",
    "rollout/partial_samples",  # continuations of samples a pause (abort mode) cut short
    "rollout/partial_unsplit",  # samples whose weight_versions labels are not this client's: no per-token versions
)


@dataclasses.dataclass(eq=False)
class Server:
    """One worker (or the router): its URL and what the client knows of it."""

    url: str
    cooldown_until: float = 0.0
    weight_version: int = 0
    tp_size: int = 1
    memory: MemoryState = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.memory = MemoryState(self.url)


class Fleet:
    """Workers, router, connections and the retry / failover policy (the arguments are those of
    :class:`~sapo_megatron.rollout.sglang.client.SGLangClient`)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        router_url: str | None,
        api_key: str | None,
        tp_sizes: Sequence[int],
        max_concurrency: int,
        timeout_s: float,
        max_retries: int,
        backoff_s: float,
        max_backoff_s: float,
        cooldown_s: float,
    ) -> None:
        self.servers = [Server(url.rstrip("/"), tp_size=t) for url, t in zip(urls, tp_sizes)]
        self.router = Server(router_url.rstrip("/")) if router_url else None
        self.router_usable = self.router is not None
        self.weight_version = 0  # the version the current workers hold
        self.pause = PauseState()  # set by ControlPlane.pause_generation / continue_generation
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.cooldown_s = cooldown_s
        self.lock = threading.Lock()
        self.busy = 0  # generate / score calls in flight (a memory release must wait for them)
        self._round_robin = itertools.count()
        self._counters = dict.fromkeys(COUNTERS, 0.0)
        self.http = httpx.Client(
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
    def router_url(self) -> str | None:
        """The router that ``/generate`` goes to, or None (no router, or bypassed after a partial update)."""
        return self.router.url if self.router is not None and self.router_usable else None

    # ------------------------------------------------------------------ HTTP
    def request(
        self,
        method: str,
        server: Server,
        path: str,
        payload: dict[str, Any] | None,
        *,
        request: str,
        timeout: float | None = None,
        expect_json: bool = True,
    ) -> Any:
        """The reply of one call (JSON, or the text with ``expect_json=False``), or a typed error (:mod:`.errors`)."""
        response = self.send(method, server, path, payload, request=request, timeout=timeout)
        check_status(response, server=server.url, path=path, request=request)
        if not expect_json:
            return response.text
        return json_reply(response, server=server.url, path=path, request=request)

    def send(
        self,
        method: str,
        server: Server,
        path: str,
        payload: dict[str, Any] | None,
        *,
        request: str,
        timeout: float | None = None,
    ) -> httpx.Response:
        """The raw response of one call, whatever its status; :class:`Unreachable` when there is none."""
        try:
            return self.http.request(
                method, server.url + path, json=payload, timeout=timeout or httpx.USE_CLIENT_DEFAULT
            )
        except httpx.TransportError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}", server=server.url, request=request) from exc

    # ------------------------------------------------------------------ the error policy
    def with_failover(
        self,
        rid_base: str,
        attempt: Callable[[Server, str], T],
        cancel: threading.Event,
        retry_if: Callable[[T], bool] | None = None,
    ) -> T:
        """``attempt(server, rid)`` until it succeeds: a transient error cools the server down and the next attempt
        goes to another server, after an exponential backoff; a lasting error is raised at once. ``retry_if``: a
        result to try again (an aborted generation), returned anyway after the last attempt."""
        last_server: Server | None = None
        last_error: TransientError | None = None
        result: T | None = None
        for attempt_index in range(self.max_retries + 1):
            if cancel.is_set():
                raise Cancelled
            server = self.pick_server(avoid=last_server)
            if attempt_index:
                self.count("rollout/retries", 1)
                if last_server is not None and server is not last_server:
                    self.count("rollout/failovers", 1)
            rid = f"{rid_base}-a{attempt_index}"
            self.count("rollout/requests", 1)
            try:
                result = attempt(server, rid)
            except Exception as exc:
                if on_error(exc, OnTransient.FAIL_OVER) is OnTransient.RAISE:
                    raise
                assert isinstance(exc, TransientError)
                last_error = exc
                self.count("rollout/transient_errors", 1)
                self.cool_down(server)
                logger.warning(
                    "attempt %d of %s on %s failed: %s", attempt_index, rid_base, server.url, exc.detail
                )
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
        raise Unavailable(
            f"request failed on {self.max_retries + 1} attempts, last error: "
            f"{last_error.detail if last_error else None}",
            server=last_server.url if last_server else None,
            request=rid_base,
            field="transport",
        ) from last_error

    def call_each(
        self,
        fn: Callable[[Server], T],
        *,
        what: str,
        on_transient: OnTransient,
        servers: Sequence[Server] | None = None,
        interruptible: bool = False,
    ) -> list[tuple[Server, T]]:
        """``fn`` on every worker (or ``servers``) in parallel; the servers that succeeded with their results.

        A lasting error is raised (the first in server order); a transient one is raised as :class:`Unavailable`
        (``RAISE``), leaves the server out (``SKIP``: :class:`Unavailable` when none is left) or also cools it down
        (``COOL_DOWN``). ``interruptible``: a
        stop signal ends the wait (weight updates; see ``interrupts.wait_for``)."""
        if on_transient is OnTransient.FAIL_OVER:
            raise ValueError("call_each runs one call per server: use with_failover to fail over")
        chosen = list(self.servers if servers is None else servers)
        done: list[tuple[Server, T]] = []
        skipped: list[tuple[Server, TransientError]] = []
        for server, outcome in zip(chosen, self.for_each(chosen, fn, interruptible=interruptible)):
            if not isinstance(outcome, Exception):
                done.append((server, outcome))
                continue
            action = on_error(outcome, on_transient)
            if action is OnTransient.RAISE:
                if isinstance(outcome, TransientError):
                    raise unavailable(what, outcome, server.url) from outcome
                raise outcome
            assert isinstance(outcome, TransientError)
            if action is OnTransient.COOL_DOWN:
                self.cool_down(server)
            skipped.append((server, outcome))
            logger.warning("%s on %s failed: %s", what, server.url, outcome.detail)
        if on_transient is OnTransient.SKIP and skipped and not done:
            first, exc = skipped[0]
            raise Unavailable(
                f"{what}: no worker was reachable: {exc.detail}", server=first.url, field="transport"
            )
        return done

    def pick_server(self, avoid: Server | None) -> Server:
        """The router when usable and not cooling down; else round-robin over workers with the current weights,
        skipping those on cooldown while others remain."""
        with self.lock:
            current = [s for s in self.servers if s.weight_version == self.weight_version]
            if not current:
                raise RolloutError("no worker holds the current weights; run a weight update again")
            now = time.monotonic()
            router = self.router if self.router_usable else None
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

    def cool_down(self, server: Server) -> None:
        with self.lock:
            server.cooldown_until = time.monotonic() + self.cooldown_s

    # ------------------------------------------------------------------ running calls
    def run_all(self, tasks: list[tuple[Callable[..., None], tuple[Any, ...]]]) -> None:
        """Run ``fn(*args, cancel)`` of each task on the pool; on the first lasting failure cancel the rest and raise
        it. Counts as busy meanwhile (see ``busy``)."""
        cancel = threading.Event()
        with self.lock:
            self.busy += 1
        try:
            pending = {self._pool.submit(fn, *args, cancel) for fn, args in tasks}
            errors: list[BaseException] = []
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    exc = future.exception()
                    if exc is not None and not isinstance(exc, Cancelled):
                        cancel.set()
                        errors.append(exc)
        finally:
            with self.lock:
                self.busy -= 1
        if errors:
            raise errors[0]

    def for_each(
        self, servers: Sequence[Server], fn: Callable[[Server], T], *, interruptible: bool = False
    ) -> list[T | Exception]:
        """Run ``fn`` on every server in parallel; results or the exceptions raised, in server order."""

        def guarded(server: Server) -> T | Exception:
            try:
                return fn(server)
            except Exception as exc:
                return exc

        if interruptible:
            futures = [self.background(functools.partial(guarded, server)) for server in servers]
            wait_for(futures, "waiting for the rollout servers")
            return [future.result() for future in futures]
        return list(self._pool.map(guarded, servers))

    def background(self, fn: Callable[[], T]) -> Future[T]:
        """``fn`` on its own daemon thread: a stop signal can end the wait for it, and neither the exit nor
        :meth:`close` waits for the thread."""
        future: Future[T] = Future()

        def runner() -> None:
            try:
                result = fn()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

        threading.Thread(target=runner, name="sglang-client-weight-sync", daemon=True).start()
        return future

    # ------------------------------------------------------------------ weights, memory, health
    def current_workers(self) -> list[Server]:
        """The workers that hold the current weights (those generation may use)."""
        with self.lock:
            return [s for s in self.servers if s.weight_version == self.weight_version]

    def make_current(self, updated: Sequence[Server]) -> tuple[list[str], bool]:
        """The end of a weight update: ``updated`` hold the new weights, every other worker is stale and left out.
        Returns the stale workers and whether the router was bypassed now (it would still send to them)."""
        with self.lock:
            self.weight_version += 1
            for server in updated:
                server.weight_version = self.weight_version
                server.cooldown_until = 0.0
            stale = [s.url for s in self.servers if s.weight_version != self.weight_version]
            self._counters["rollout/stale_servers"] = float(len(stale))
            bypass_router = bool(stale) and self.router_usable
            if bypass_router:
                self.router_usable = False
        return stale, bypass_router

    def require_memory(self, tags: Sequence[str], what: str) -> None:
        """Refuse ``what`` before anything is sent while a worker holds a memory it needs released."""
        for server in self.servers:
            server.memory.require(tags, what)

    def server_health(self) -> dict[str, bool]:
        """Per worker: whether it answers ``GET /health`` with 200 (within 10 s)."""

        def probe(server: Server) -> bool:
            self.request("GET", server, "/health", None, request="health", timeout=10.0, expect_json=False)
            return True

        outcomes = self.for_each(self.servers, probe)
        return {s.url: outcome is True for s, outcome in zip(self.servers, outcomes)}

    def count(self, key: str, value: float) -> None:
        with self.lock:
            self._counters[key] += value

    def metrics(self) -> dict[str, float]:
        with self.lock:
            return dict(self._counters)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.http.close()
