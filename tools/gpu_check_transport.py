"""Two rows of tools/gpu_check.py that cross process or group boundaries, and the receiving process of one.

- :func:`group_of_one`: the process group that ``init_parallel`` made (NCCL on a GPU, gloo on CPU) and Megatron's
  data-parallel group over it: all-reduce, broadcast, all-gather into a tensor, a new subgroup, a barrier.
- :func:`tensor_transport`: weights handed to a second process as ``rollout.weight_sync=tensor`` hands them to a
  colocated server (``sapo_megatron.rollout.tensor_transport``): named tensors and a flattened bucket, as CUDA IPC
  handles on a GPU (the receiver opens them as SGLang's ``MultiprocessingSerializer`` does, with torch's
  reductions) and as shared-memory file handles on CPU (the receiver is the project's restricted reader). The
  receiver checks the bytes and writes into one tensor; the sender sees the write, so nothing was copied.

    python tools/gpu_check_transport.py   # the receiver: one JSON request on stdin, one JSON answer on stdout
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import torch

RECEIVER_TIMEOUT_S = 180


def group_of_one(device: torch.device) -> str:
    """Collectives on the one-rank group ``init_parallel`` created (the backend a GPU run trains with)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    backend = dist.get_backend()
    expected = "nccl" if device.type == "cuda" else "gloo"
    if backend != expected:
        raise AssertionError(f"the default process group is {backend}, expected {expected} on {device.type}")
    values = torch.arange(1 << 20, dtype=torch.float32, device=device)  # 4 MiB
    reduced = values.clone()
    start = time.perf_counter()
    dist.all_reduce(reduced)
    dist.all_reduce(reduced, group=parallel_state.get_data_parallel_group())
    dist.broadcast(reduced, src=0)
    gathered = torch.empty_like(values)
    dist.all_gather_into_tensor(gathered, reduced)
    sub = dist.new_group([0], backend=expected)
    dist.all_reduce(gathered, group=sub)
    dist.barrier()
    _sync(device)
    ms = (time.perf_counter() - start) * 1e3
    if not torch.equal(gathered, values):
        raise AssertionError("a collective over one rank changed the values")
    return f"{backend}: all_reduce (default, data-parallel), broadcast, all_gather_into_tensor, subgroup, barrier in {ms:.1f} ms"


def tensor_transport(device: torch.device) -> str:
    """Send named tensors and a flattened bucket to a second process; it checks them and writes into one."""
    from sapo_megatron.rollout.tensor_transport import (
        TensorTransportError,
        deserialize_named_tensors,
        flattened_buckets,
        serialize_flattened_bucket,
        serialize_named_tensors,
    )

    gen = torch.Generator().manual_seed(5)
    named = [
        ("layers.0.weight", torch.randn(256, 128, generator=gen).to(device, torch.bfloat16)),
        ("layers.0.bias", torch.randn(256, generator=gen).to(device)),
        ("embed.weight", torch.randn(1024, 64, generator=gen).to(device, torch.bfloat16)),
    ]
    (bucket,) = flattened_buckets(named[::2])  # the two bf16 tensors in one bucket
    sharing = None if device.type == "cuda" else "file_system"  # CUDA storages travel as IPC handles anyway
    # CUDA handles open only through torch's reductions; shared-memory files through both readers
    readers = ["torch"] if device.type == "cuda" else ["restricted", "torch"]
    request = {
        "device": device.type,
        "readers": readers,
        "sender_pid": os.getpid(),
        "named": serialize_named_tensors(named, sharing=sharing),
        "bucket": serialize_flattened_bucket(bucket, sharing=sharing),
    }
    if device.type == "cuda":  # the CPU server's reader must refuse CUDA handles with its clear message
        try:
            deserialize_named_tensors(request["named"])
        except TensorTransportError as err:
            if "CUDA IPC handles" not in str(err):
                raise
        else:
            raise AssertionError("the restricted reader opened a CUDA payload")
    expected = {name: _digest(t) for name, t in named}
    bucket_expected = {name: _digest(t) for name, t in named[::2]}
    start = time.perf_counter()
    answer = _receive(request)
    seconds = time.perf_counter() - start
    for reader in readers:
        got = answer["readers"][reader]
        if got["named"] != expected or got["bucket"] != bucket_expected:
            raise AssertionError(
                f"{reader} reader: tensors differ in the receiver: {got} vs {expected}, {bucket_expected}"
            )
    _sync(device)
    if not torch.all(named[1][1] == -1).item():
        raise AssertionError("the receiver's write did not reach the sender's tensor: the payload was a copy")
    route = "CUDA IPC handles" if device.type == "cuda" else "shared-memory files (file_system)"
    return (
        f"{route}: {len(named)} named tensors and a {bucket['flattened_tensor'].numel() / 2**10:.0f} KiB bucket "
        f"opened in pid {answer['pid']} on {answer['device']} by {' and '.join(readers)} readers, bytes equal, its "
        "write seen here; round trip "
        f"{seconds:.1f} s (the receiver imports torch)"
    )


def _receive(request: dict) -> dict:
    root = str(Path(__file__).resolve().parents[1])  # the project, before what the sender's PYTHONPATH holds
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=RECEIVER_TIMEOUT_S,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(f"the receiving process failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _digest(tensor: torch.Tensor) -> str:
    raw = tensor.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def receiver_main() -> int:
    """Open both payloads with each reader asked for, digest every tensor, then write -1 into the named bias
    (the sender checks that it sees the write)."""
    request = json.loads(sys.stdin.read())
    answer: dict = {"pid": os.getpid(), "readers": {}}
    for reader in request["readers"]:
        named, views = _open(request, reader)
        answer["device"] = str(named[0][1].device)
        answer["readers"][reader] = {
            "named": {name: _digest(t) for name, t in named},
            "bucket": {name: _digest(t) for name, t in views},
        }
    dict(named)["layers.0.bias"].fill_(-1)
    _sync(named[0][1].device)
    print(json.dumps(answer), flush=True)
    return 0


def _open(request: dict, reader: str) -> tuple[list, list]:
    """(named tensors, bucket views) of the request's payloads. ``torch``: torch's own reductions, as SGLang's
    ``MultiprocessingSerializer`` opens them (the only reader for CUDA IPC handles); ``restricted``: the project's
    reader (CPU handles only)."""
    if reader == "torch":
        named = pickle.loads(base64.b64decode(request["named"]))
        bucket = pickle.loads(base64.b64decode(request["bucket"]))
        flat = bucket["flattened_tensor"]
        views = [
            (m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in bucket["metadata"]
        ]
        return named, views
    from sapo_megatron.rollout.tensor_transport import deserialize_flattened_bucket, deserialize_named_tensors

    pids = [request["sender_pid"]]
    named = deserialize_named_tensors(request["named"], allowed_pids=pids)
    return named, deserialize_flattened_bucket(request["bucket"], allowed_pids=pids)


if __name__ == "__main__":
    sys.exit(receiver_main())
