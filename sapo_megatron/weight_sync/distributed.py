"""The ``distributed`` weight-sync mode: a broadcast from the trainer to every worker, as SGLang's
``init_weights_update_group`` + ``update_weights_from_distributed`` expect it.

Per pipeline stage, one trainer rank (the stage's source, :func:`~sapo_megatron.megatron.weights.stage_sources`)
forms a process group with every worker's tensor-parallel ranks: the source is group rank 0 and hosts the
rendezvous store on its own address (the one that routes to the workers, or ``SAPO_WEIGHT_SYNC_ADDR``); worker ``i``
takes ranks ``rank_offsets[i] ..`` (see ``SGLangClient.weight_group_layout``). For each bucket of its stage the
source posts the tensors' names, dtypes and shapes to every worker, broadcasts the tensors in that order, and waits
for every worker to acknowledge. Backend: NCCL when the trainer has CUDA, gloo otherwise (the CPU server joins over
gloo, so CI runs a real broadcast between processes).

A failure on any rank (a worker refusing a bucket, a broken group) is shared with every rank and raised there, so
the job stops with one clear error instead of hanging in the next collective.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from concurrent.futures import wait
from datetime import timedelta
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from sapo_megatron.model.arch import QwenArch
from sapo_megatron.rollout.base import RolloutEngine, RolloutError
from sapo_megatron.runtime.interrupts import WaitInterrupted, wait_for
from sapo_megatron.weight_sync.hf_export import DEFAULT_BUCKET_BYTES, Bucket, bucket_bytes_of, hf_buckets
from sapo_megatron.weight_sync.modes import WeightSync

ADDRESS_ENV = "SAPO_WEIGHT_SYNC_ADDR"


@runtime_checkable
class _WorkerFleet(Protocol):
    """What a broadcast needs of an engine beyond :class:`RolloutEngine`: its workers (the SGLang client)."""

    @property
    def urls(self) -> list[str]: ...

    def weight_group_layout(self) -> tuple[int, list[int]]: ...

    def destroy_weights_update_group(self, group_name: str = ...) -> None: ...


class DistributedSync(WeightSync):
    """Broadcast weight sync; ``make_client`` builds the HTTP client on stage sources other than the main rank."""

    def __init__(
        self,
        engine: RolloutEngine | None,
        arch: QwenArch,
        *,
        stage: int,
        make_client: Callable[[], RolloutEngine],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 1800.0,
    ) -> None:
        super().__init__(engine, arch)
        self.stage = stage
        self.make_client = make_client
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.group_name = f"sapo_weights_pp{stage}"
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self._client: RolloutEngine | None = None
        self._group: dist.ProcessGroup | None = None

    def _push(self, module: torch.nn.Module) -> int:
        sent, error = 0, None
        for bucket in hf_buckets(module, self.arch, self.bucket_bytes, per_stage=True):
            if (
                bucket and error is None
            ):  # only the stage's source receives tensors; always drain the iterator
                try:
                    sent += self._broadcast(bucket)
                except Exception as exc:  # shared with every rank below, then raised everywhere
                    error = exc
        _raise_on_every_rank(error)
        if self.engine is not None:
            self.engine.finish_weight_update()
        return sent

    def _broadcast(self, bucket: Bucket) -> int:
        from sapo_megatron.rollout.weight_group import broadcast_bucket, tensor_metadata

        client, group = self._ensure_group()
        names, dtypes, shapes = tensor_metadata(bucket)
        acknowledged = client.update_weights_from_distributed(
            names, dtypes, shapes, group_name=self.group_name
        )
        try:
            # ``reply``: a worker that refuses the bucket fails the broadcast at once, not after the group timeout
            broadcast_bucket(group, [t for _, t in bucket], reply=acknowledged, timeout_s=self.timeout_s)
            wait_for([acknowledged], "update_weights_from_distributed")
            acknowledged.result(timeout=self.timeout_s)
        except Exception:
            self._drop_group()  # unmatched sends may remain in it: the next push forms a new one
            raise
        return bucket_bytes_of(bucket)

    def _ensure_group(self) -> tuple[RolloutEngine, dist.ProcessGroup]:
        if self._group is not None and self._client is not None:
            return self._client, self._group
        from sapo_megatron.rollout.weight_group import init_custom_process_group

        client = self._client = self.engine if self.engine is not None else self.make_client()
        if not isinstance(client, _WorkerFleet):
            raise RolloutError(
                f"weight sync 'distributed' broadcasts to SGLang workers; {type(client).__name__} has none"
            )
        world_size, rank_offsets = client.weight_group_layout()
        address = local_address_towards(client.urls[0])
        port = free_port_on(address)
        joined = client.init_weights_update_group(
            address, port, world_size, rank_offsets, group_name=self.group_name, backend=self.backend
        )
        wait([joined], timeout=1.0)  # a worker that refuses at once (bad backend, group exists) fails fast
        refused = joined.exception() if joined.done() else None
        if refused is not None:
            raise refused
        group = self._group = init_custom_process_group(
            backend=self.backend,
            master_address=address,
            master_port=port,
            world_size=world_size,
            rank=0,
            group_name=self.group_name,
            timeout=timedelta(seconds=self.timeout_s),
        )
        wait_for([joined], "init_weights_update_group")
        joined.result(timeout=self.timeout_s)
        return client, group

    def _drop_group(self) -> None:
        from sapo_megatron.rollout.weight_group import destroy_custom_process_group

        group, self._group = self._group, None
        if group is None:
            return
        with contextlib.suppress(Exception):  # best effort: the group may already be broken
            if isinstance(self._client, _WorkerFleet):
                self._client.destroy_weights_update_group(self.group_name)
        with contextlib.suppress(Exception):
            destroy_custom_process_group(group)

    def close(self) -> None:
        self._drop_group()
        if self._client is not None and self._client is not self.engine:
            self._client.close()


def _raise_on_every_rank(error: BaseException | None) -> None:
    """Collective: if any rank failed, raise one error naming that rank on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        if message.startswith(WaitInterrupted.__name__):  # every rank stops at the step's end, checkpointing
            raise WaitInterrupted(f"distributed weight sync on trainer rank {rank}: {message}") from error
        raise RolloutError(f"distributed weight sync failed on trainer rank {rank}: {message}") from error


def local_address_towards(url: str) -> str:
    """This host's address on the interface that routes to ``url`` (what the workers can connect back to), or
    ``$SAPO_WEIGHT_SYNC_ADDR`` when set (e.g. a specific cluster interface)."""
    override = os.environ.get(ADDRESS_ENV)
    if override:
        return override
    parts = urlsplit(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing
        probe.connect((parts.hostname or "127.0.0.1", parts.port or 80))
        return probe.getsockname()[0]


def free_port_on(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
