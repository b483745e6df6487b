"""Which servers a run talks to, found and checked before the first request.

The trainer knows the **workers** (SGLang servers, or the CPU server standing in for them). An optional
``sglang-router`` balances ``/generate`` only: it has no weight-update routes (sglang-router 0.3.2 answers 404 to
``/update_weights_from_disk``, ``/init_weights_update_group``, ``/update_weights_from_distributed`` and
``/update_weights_from_tensor``), so weight sync, cache flushes, health and model info always go to every worker.

Facts about sglang-router 0.3.2 this module relies on (measured against the real binary, see
tests/rollout/test_router.py, and read in ``sgl-router/src/server.rs``):

- ``GET /workers`` lists the workers: ``{"workers": [{"url", "is_healthy", "model_id", ...}], "total": n}``.
- It registers its ``--worker-urls`` in a background job ("Worker initialization job submitted (will complete
  in background)" in its log): ``/health`` answers 200 while ``/workers`` is still empty, for about half a
  second on an idle machine and longer under load (seen in CI). Discovery through the router therefore waits
  until the list is non-empty and unchanged for :data:`_SETTLE_S` (see :func:`wait_router_workers`).
- It parses ``/generate`` bodies into its own request type and forwards only the fields it knows:
  ``return_routed_experts`` is dropped, so replies through the router carry no ``routed_experts``. A run that
  needs routes therefore sends ``/generate`` to the workers directly (probed at start, see :func:`probe_routes`).
- With ``--api-key K`` it refuses requests without ``Authorization: Bearer K`` (401; ``/health`` stays open) and
  sends the same header to the workers, so one key protects router and workers alike.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sapo_megatron.rollout.base import RolloutError
from sapo_megatron.runtime.interrupts import WaitInterrupted, stop_requested

Log = Callable[[str], None]
_POLL_S = 1.0
_REPORT_EVERY_S = 30.0
_SETTLE_S = 2.0


@dataclass(frozen=True)
class Topology:
    """The servers of a run: workers (with their tensor-parallel sizes) and an optional router."""

    workers: tuple[str, ...]
    router: str | None = None
    generate_via_router: bool = False
    tp_sizes: tuple[int, ...] = ()

    @property
    def generation_urls(self) -> tuple[str, ...]:
        """Where ``/generate`` goes: the router when it may be used, else the workers."""
        return (self.router,) if self.generate_via_router and self.router else self.workers


def auth_headers(api_key: str | None) -> dict[str, str]:
    """SGLang's ``--api-key`` scheme (and sglang-router's): a Bearer token."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def resolve_topology(
    *,
    urls: Sequence[str] = (),
    router_url: str | None = None,
    endpoints_file: str | None = None,
    api_key: str | None = None,
    need_routes: bool = False,
    precision: str | None = None,
    probe_prompt: Sequence[int] = (0,),
    timeout_s: float = 900.0,
    log: Log = print,
) -> Topology:
    """Find the workers, wait until every server is healthy, read their sizes and decide where ``/generate``
    goes. Raises :class:`RolloutError` naming the server and what to do when something is missing or late."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10.0, headers=auth_headers(api_key)) as http:
        if endpoints_file:
            router_url, urls = read_endpoints_file(endpoints_file, deadline, log)
        router = router_url.rstrip("/") if router_url else None
        if router:
            wait_healthy(http, [router], deadline, log, what="sglang-router")
        workers = [u.rstrip("/") for u in urls] or wait_router_workers(http, router, deadline, log)
        wait_healthy(http, workers, deadline, log, what="rollout worker")
        infos = [_get_json(http, url, "/get_server_info") for url in workers]
        tp_sizes = tuple(worker_tp_size(info, url) for info, url in zip(infos, workers))
        if precision is not None:
            for info, url in zip(infos, workers):
                served = served_precision(info)
                if served is not None and served != precision:
                    log(
                        f"warning: {url} serves {served} (dtype/quantization in /get_server_info) but "
                        f"rollout.precision is {precision}; the trainer cannot change a server's precision"
                    )
        via_router = router is not None
        if need_routes:
            if not probe_routes(http, workers[0], probe_prompt):
                raise RolloutError(
                    "the rollout workers do not return routed experts; start them with "
                    "--enable-return-routed-experts (launch/slurm_rollout.sbatch: SAPO_ROUTED_EXPERTS=1)",
                    server=workers[0],
                    field="meta_info.routed_experts",
                )
            if router is not None and not probe_routes(http, router, probe_prompt):
                log(
                    f"sglang-router at {router} drops return_routed_experts; sending /generate to the "
                    f"{len(workers)} workers directly"
                )
                via_router = False
    return Topology(tuple(workers), router, via_router, tp_sizes)


def read_endpoints_file(path: str, deadline: float, log: Log) -> tuple[str | None, list[str]]:
    """Wait for the JSON that the rollout job writes (atomically) and read ``router_url`` and ``workers``."""
    file = Path(path)
    started = time.monotonic()
    last_report = started - _REPORT_EVERY_S
    while not file.is_file():
        now = time.monotonic()
        if now > deadline:
            raise RolloutError(
                f"rollout endpoints file {file} did not appear within {now - started:.0f} s; is the rollout job "
                "(launch/slurm_rollout.sbatch) running and writing to this path?",
                field="rollout.endpoints_file",
            )
        if now - last_report >= _REPORT_EVERY_S:
            log(f"waiting for the rollout job to write {file} ...")
            last_report = now
        time.sleep(_POLL_S)
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise RolloutError(f"rollout endpoints file {file} is not valid JSON: {exc}") from exc
    workers = data.get("workers") if isinstance(data, dict) else None
    router = data.get("router_url") if isinstance(data, dict) else None
    if not isinstance(workers, list) or not workers or not all(isinstance(u, str) for u in workers):
        raise RolloutError(f"rollout endpoints file {file}: 'workers' must be a non-empty list of URLs")
    if router is not None and not isinstance(router, str):
        raise RolloutError(f"rollout endpoints file {file}: 'router_url' must be a URL or null")
    return router, workers


def list_router_workers(http: httpx.Client, router: str) -> list[str]:
    """The workers registered with an sglang-router now (``GET /workers``); empty while it registers them."""
    reply = _get_json(http, router, "/workers")
    entries = reply.get("workers") if isinstance(reply, dict) else None
    if not isinstance(entries, list):
        raise RolloutError(
            "GET /workers did not list workers; is this an sglang-router?", server=router, field="workers"
        )
    return [e["url"].rstrip("/") for e in entries if isinstance(e, dict) and isinstance(e.get("url"), str)]


def wait_router_workers(http: httpx.Client, router: str | None, deadline: float, log: Log) -> list[str]:
    """The router's workers once it has registered some and the list has not changed for :data:`_SETTLE_S`
    (it registers them in the background after ``/health`` is already 200). For an exact list that does not
    depend on timing, give ``rollout.urls`` or ``rollout.endpoints_file``."""
    if router is None:
        raise RolloutError("no rollout workers: set rollout.urls or rollout.router_url")
    started = time.monotonic()
    last_report = started
    seen: list[str] = []
    seen_since = started
    while True:
        now = time.monotonic()
        workers = list_router_workers(http, router)
        if workers != seen:
            seen, seen_since = workers, now
        elif seen and now - seen_since >= _SETTLE_S:
            return seen
        if now > deadline and seen:
            return seen
        if now > deadline:
            raise RolloutError(
                f"the router has no workers registered after {now - started:.0f} s; start it with --worker-urls "
                "(or add workers), or set rollout.urls",
                server=router,
                field="workers",
            )
        if now - last_report >= _REPORT_EVERY_S:
            log(f"waiting for sglang-router at {router} to register its workers ({len(seen)} so far) ...")
            last_report = now
        time.sleep(min(_POLL_S, _SETTLE_S / 4))


def wait_healthy(http: httpx.Client, urls: Sequence[str], deadline: float, log: Log, *, what: str) -> None:
    """Poll ``GET /health`` on every URL until all answer 200, saying who is still starting."""
    pending = list(urls)
    started = time.monotonic()
    last_report = started - _REPORT_EVERY_S
    while pending:
        pending = [url for url in pending if not _is_healthy(http, url)]
        if not pending:
            return
        now = time.monotonic()
        if now > deadline:
            raise RolloutError(
                f"{len(pending)} {what}(s) not healthy after {now - started:.0f} s: {', '.join(pending)}; "
                "check the rollout job's log, or raise rollout.startup_timeout_s",
                server=pending[0],
                field="/health",
            )
        if now - last_report >= _REPORT_EVERY_S:
            log(f"waiting for {len(pending)} {what}(s) to become healthy: {', '.join(pending)}")
            last_report = now
        time.sleep(_POLL_S)


_NOT_SGLANG = (404, 405, 501)
"""Answers to ``GET /health`` that no SGLang server, router or ``sapo-megatron serve`` gives, starting or not:
the peer is another kind of server, and waiting for it would wait until the start-up timeout."""


def _is_healthy(http: httpx.Client, url: str) -> bool:
    if stop_requested():
        raise WaitInterrupted(f"waiting for {url} to become healthy: interrupted by a signal")
    try:
        status = http.get(url + "/health").status_code
    except httpx.TransportError:
        return False
    if status in _NOT_SGLANG:
        raise RolloutError(
            f"{url} answers {status} to GET /health: it is no SGLang server, sglang-router or sapo-megatron "
            "serve (they all answer /health); check the URL and its port",
            server=url,
            field="/health",
        )
    return status == 200


def worker_tp_size(info: Any, url: str) -> int:
    """A worker's tensor-parallel size from its ``GET /get_server_info`` (SGLang's server args; 1 if absent)."""
    size = info.get("tp_size", 1) if isinstance(info, dict) else 1
    if not isinstance(size, int) or size < 1:
        raise RolloutError(f"tp_size {size!r} is not a positive integer", server=url, field="tp_size")
    return size


def served_precision(info: Any) -> str | None:
    """``fp8`` / ``bf16`` / ``fp32`` from SGLang's server args (``quantization``, ``dtype``); None if unknown."""
    if not isinstance(info, dict):
        return None
    if info.get("quantization") == "fp8":
        return "fp8"
    return {"bfloat16": "bf16", "float32": "fp32", "float": "fp32"}.get(str(info.get("dtype")))


def probe_routes(http: httpx.Client, url: str, prompt: Sequence[int]) -> bool:
    """Whether ``url`` answers a one-token ``/generate`` with ``meta_info.routed_experts``."""
    payload = {
        "input_ids": list(prompt),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_routed_experts": True,
    }
    reply = _request_json(http, "POST", url, "/generate", payload)
    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    return isinstance(meta, dict) and meta.get("routed_experts") is not None


def _get_json(http: httpx.Client, url: str, path: str) -> Any:
    return _request_json(http, "GET", url, path, None)


def _request_json(http: httpx.Client, method: str, url: str, path: str, payload: Any) -> Any:
    try:
        response = http.request(method, url + path, json=payload, timeout=60.0)
    except httpx.TransportError as exc:
        raise RolloutError(f"{method} {path} failed: {exc}", server=url, field="transport") from exc
    if response.status_code == 401:
        raise RolloutError(
            f"{method} {path} was refused (401): the server wants an API key; export it in the variable named by "
            "rollout.api_key_env (default SAPO_ROLLOUT_API_KEY)",
            server=url,
            field="Authorization",
        )
    if response.status_code != 200:
        raise RolloutError(
            f"{method} {path} answered HTTP {response.status_code}: {response.text[:200]}",
            server=url,
            field=path,
        )
    try:
        return response.json()
    except ValueError as exc:
        raise RolloutError(f"{method} {path} did not answer JSON: {exc}", server=url, field=path) from exc
