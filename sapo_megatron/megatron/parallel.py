"""Process groups: torch.distributed (NCCL on GPUs, gloo on CPU) and Megatron's model-parallel state.

Rank, world size and rendezvous come from the environment that ``torchrun`` / ``srun`` set
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); without them the job is a single
process with an in-memory store.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from sapo_megatron.config import ParallelConfig, RunConfig, validate_layout
from sapo_megatron.megatron import cpu_compat


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job and in the Megatron layout."""

    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_rank: int
    dp_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_from_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the launcher's environment; (0, 1, 0) without one."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    return rank, world, local


def init_parallel(
    par: ParallelConfig,
    *,
    seed: int,
    timeout_minutes: int = 30,
    cfg: RunConfig | None = None,
    cpu_threads: int | None = None,
) -> RankInfo:
    """Create the process group and Megatron's parallel state; seed the (model-parallel) RNGs.

    ``cfg`` (a RunConfig), when given, is re-validated against the real world size first, so a layout error
    is reported before any group exists. ``cpu_threads`` sets torch's threads on machines without CUDA.
    """
    rank, world, local_rank = world_from_env()
    if cfg is not None:
        validate_layout(cfg, world)
    if cpu_compat.apply() and cpu_threads:
        torch.set_num_threads(cpu_threads)
    if not dist.is_initialized():
        _init_process_group(rank, world, local_rank, timeout_minutes)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return rank_info()


def _init_process_group(rank: int, world: int, local_rank: int, timeout_minutes: int) -> None:
    timeout = timedelta(minutes=timeout_minutes)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    if world == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)


def rank_info() -> RankInfo:
    return RankInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank())),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
    )


def data_parallel_group() -> dist.ProcessGroup:
    return parallel_state.get_data_parallel_group()


def shutdown_parallel() -> None:
    """Tear down Megatron's parallel state and the process group (safe to call twice)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def parallel_context(cfg: RunConfig, *, seed: int = 0) -> Iterator[None]:
    """Megatron parallel state for ``cfg.parallel`` for the duration of the block (offline tools: the parity
    check, tests).

    Reuses the caller's state when Megatron's parallel state already exists (the caller chose the layout);
    otherwise creates it (and the process group, from the launcher's environment, when there is none) and
    tears down what it created.
    """
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        yield
        return
    created_group = not dist.is_initialized()
    init_parallel(cfg.parallel, seed=seed, cfg=cfg)
    try:
        yield
    finally:
        if created_group:
            shutdown_parallel()
        else:
            parallel_state.destroy_model_parallel()


def is_reporting_rank() -> bool:
    """The one rank that reports for the model: last pipeline stage, first TP and DP rank."""
    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    )
