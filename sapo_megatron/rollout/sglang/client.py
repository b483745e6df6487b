"""Rollout engine over SGLang servers (or the CPU server standing in for them) over the native HTTP API,
optionally through an ``sglang-router`` for ``/generate``.

:class:`SGLangClient` composes three parts, each in its own module:

- :class:`~.fleet.Fleet` (``fleet.py``): the workers, the router, connections, health, and the one retry / failover
  policy over the typed errors of ``errors.py``: a transient failure (connection error, timeout, HTTP 429/5xx, an
  aborted generation) puts that server on cooldown and retries on the next server with exponential backoff; a
  malformed reply or an HTTP 4xx is a misconfiguration and raises :class:`RolloutError` naming the server, the
  request id and the field;
- :class:`~.generation.GenerationClient` (``generation.py``): ``generate`` and ``score``, one HTTP request per
  sample, so a failure costs one sample, not a group; every (group, index) slot is filled exactly once;
- :class:`~.control.ControlPlane` (``control.py``): weight updates (disk, tensors, NCCL), SGLang's update sessions,
  cache flushes, memory release / resume and weight checksums, on every worker.

Topology (see :mod:`topology`): ``urls`` are the workers; ``router_url``, when given, receives ``/generate`` (it
balances the load itself); weight updates, cache flushes and health checks go to every worker. When the router
fails, generation fails over to the workers directly; after a weight update that a worker missed, generation
bypasses the router for good (it cannot be told to skip a stale worker).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

import torch

from sapo_megatron.rollout.base import RolloutEngine
from sapo_megatron.rollout.sglang.control import ControlPlane
from sapo_megatron.rollout.sglang.fleet import Fleet
from sapo_megatron.rollout.sglang.generation import GenerationClient
from sapo_megatron.rollout.types import GenerationRequest, ImageInputs, Sample


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
        flatten_buckets: send each tensor bucket as one flattened tensor per dtype (SGLang's ``flattened_bucket``).

    The parts are public: ``fleet`` (:class:`Fleet`), ``generation`` (:class:`GenerationClient`) and ``control``
    (:class:`ControlPlane`).
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
        self.fleet = Fleet(
            url_list,
            router_url=router_url,
            api_key=api_key,
            tp_sizes=tp_sizes,
            max_concurrency=max_concurrency,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            cooldown_s=cooldown_s,
        )
        self.generation = GenerationClient(
            self.fleet, num_layers=num_layers, top_k=top_k, vocab_size=vocab_size
        )
        self.control = ControlPlane(
            self.fleet,
            weight_sync_timeout_s=weight_sync_timeout_s,
            serializer=serializer,
            flatten_buckets=flatten_buckets,
        )

    @property
    def urls(self) -> list[str]:
        """The workers."""
        return [s.url for s in self.fleet.servers]

    @property
    def router_url(self) -> str | None:
        """The router that ``/generate`` goes to, or None (no router, or bypassed after a partial update)."""
        return self.fleet.router_url

    # ------------------------------------------------------------------ generation (generation.py)
    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        return self.generation.generate(requests)

    def score(
        self,
        token_ids_list: Sequence[Sequence[int]],
        response_start: int | Sequence[int],
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[list[float]]:
        return self.generation.score(token_ids_list, response_start, images)

    # ------------------------------------------------------------------ the control plane (control.py)
    def update_weights_from_disk(self, path: str, *, flush_cache: bool = True) -> None:
        self.control.update_weights_from_disk(path, flush_cache=flush_cache)

    def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.control.update_weights_from_tensors(named_tensors)

    def weight_group_layout(self) -> tuple[int, list[int]]:
        """``(world_size, rank_offsets)`` of a weight-update group (see :class:`ControlPlane`)."""
        return self.control.weight_group_layout()

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offsets: Sequence[int],
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> Future[None]:
        return self.control.init_weights_update_group(
            master_address, master_port, world_size, rank_offsets, group_name, backend
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
    ) -> Future[None]:
        return self.control.update_weights_from_distributed(names, dtypes, shapes, group_name)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """``POST /destroy_weights_update_group`` on every worker (after a failed broadcast, or at the end)."""
        self.control.destroy_weights_update_group(group_name)

    def finish_weight_update(self, *, flush_cache: bool = True) -> None:
        """The workers that acknowledged every call since the last update become the current ones; then flush."""
        self.control.finish_weight_update(flush_cache=flush_cache)

    def pause_generation(self, mode: str = "in_place", *, timeout_s: float = 300.0) -> None:
        self.control.pause_generation(mode, timeout_s=timeout_s)

    def continue_generation(self, *, timeout_s: float = 300.0) -> None:
        self.control.continue_generation(timeout_s=timeout_s)

    def served_weight_version(self) -> int:
        return self.fleet.weight_version

    def flush_cache(self) -> None:
        self.control.flush_cache()

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Release the workers' memory ``tags`` (None or ``[]``: all); see :meth:`ControlPlane.release_memory`."""
        self.control.release_memory(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Resume released memory ``tags`` (None or ``[]``: all); see :meth:`ControlPlane.resume_memory`."""
        self.control.resume_memory(tags)

    def released_memory(self) -> dict[str, list[str]]:
        """Per worker, the tags it holds released (in ``MEMORY_TAGS`` order)."""
        return self.control.released_memory()

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """Per TP-1 worker, ``{served name: hex}`` from ``/weights_checker`` (see :mod:`weight_checksum`)."""
        return self.control.weight_checksums()

    # ------------------------------------------------------------------ the fleet (fleet.py)
    def health(self) -> bool:
        """True when every server answers ``GET /health`` with 200."""
        return all(self.fleet.server_health().values())

    def server_health(self) -> dict[str, bool]:
        """Per worker: whether it answers ``GET /health`` with 200."""
        return self.fleet.server_health()

    def metrics(self) -> dict[str, float]:
        return self.fleet.metrics()

    def close(self) -> None:
        self.fleet.close()
