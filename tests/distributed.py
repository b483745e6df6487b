"""Run a function on N local processes over gloo (what torchrun would do), collecting each rank's result.

The function is given by import path so that spawned children can import it; it receives ``payload`` and
returns something picklable. A failure on any rank raises in the parent with that rank's traceback.
"""

from __future__ import annotations

import importlib
import io
import os
import queue
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, target: str, payload: Any, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
        TORCHELASTIC_USE_AGENT_STORE="True",  # the parent hosts the store (see run_distributed)
    )
    try:
        module, name = target.split(":")
        result = getattr(importlib.import_module(module), name)(payload)
        buffer = io.BytesIO()
        torch.save(result, buffer)  # plain bytes: shared-memory tensors would die with this process
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report any failure, with its traceback, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        from sapo_megatron.megatron.parallel import shutdown_parallel

        shutdown_parallel()


def run_distributed(target: str, world_size: int, payload: Any = None, timeout: float = 300.0) -> list[Any]:
    """Run ``target(payload)`` on ``world_size`` processes; return the results ordered by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The parent hosts the ranks' store on a port the kernel picks, held until they are done (as torchrun's agent
    # and sapo_megatron.runtime.local_launch do): no other process can take the port before the ranks join.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, target, payload, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    try:
        while len(collected) < world_size:
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"{target} on {world_size} ranks: no result within {timeout:.0f} s"
                ) from None
            if status == "error":
                raise RuntimeError(f"rank {rank} of {target} failed:\n{value}")
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        del store
    return [collected[r] for r in range(world_size)]
