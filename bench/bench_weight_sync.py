"""Weight-sync time and bytes, ``disk`` against ``distributed`` and bucketed ``tensor``, from a Megatron trainer to a CPU server in another
process (the stand-in for an SGLang worker), measured in the same run on a Qwen3-MoE of a few hundred MB.

    python bench/bench_weight_sync.py [--hidden 768] [--layers 6] [--experts 16] [--repeats 3]

``disk`` writes an HF checkpoint (safetensors) into a new version directory and the server loads it;
``distributed`` broadcasts the same tensors bucket by bucket over a gloo group the server joined (NCCL on GPUs).
``tensor`` hands the buckets (``--bucket-mb``) to the server as named shared-memory files, ``tensor-flat`` as one
flattened tensor per dtype (what a colocated sync sends, ``rollout.colocation: time_shared``). All include the server's
loading. Prints seconds per sync (median), bytes, MB/s and the ratios to disk (lower is better).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def cpu_server(model_dir: Path):
    from sapo_megatron.rollout.cpu.process import ServerProcess

    server = ServerProcess(
        *("--model-path", str(model_dir), "--port", "0", "--threads", "1", "--dist-timeout", "600"),
        *("--tensor-sender-pid", str(os.getpid())),  # the tensor arm's shared-memory files come from here
    )
    try:
        yield server.url
    finally:
        server.stop(timeout_s=60)


def timed_pushes(sync, module, repeats: int) -> tuple[float, float]:
    sync.push(module)  # warm-up (distributed: forms the group)
    seconds, sent = [], 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        metrics = sync.push(module)
        seconds.append(time.perf_counter() - start)
        sent = metrics["weight_sync/bytes"]
    return statistics.median(seconds), sent


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--bucket-mb", type=int, default=512, help="tensor arm: bucket size (rollout.colocation.bucket_mb)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    from sapo_megatron.config import config_from_dict
    from sapo_megatron.megatron.parallel import init_parallel
    from sapo_megatron.megatron.train_step import TrainEngine
    from sapo_megatron.model.tiny import make_tiny_hf_checkpoint
    from sapo_megatron.rollout.sglang.client import SGLangClient
    from sapo_megatron.weight_sync import DiskSync, TensorSync
    from sapo_megatron.weight_sync.distributed import DistributedSync

    shape = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_experts": args.experts,
        "moe_intermediate_size": args.hidden // 2,
        "intermediate_size": 2 * args.hidden,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": args.vocab,
    }
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        hf_dir = make_tiny_hf_checkpoint(Path(tmp) / "model", "moe", seed=0, **shape)
        cfg = config_from_dict({"model": {"hf_config": str(hf_dir), "init": "hf", "init_path": str(hf_dir)}})
        init_parallel(cfg.parallel, seed=0)
        module = TrainEngine(cfg).module
        model_mb = sum(p.numel() * p.element_size() for p in module.parameters()) / 1e6
        with cpu_server(hf_dir) as url, SGLangClient([url], timeout_s=600) as client:
            disk = DiskSync(client, cfg.model.arch, staging_dir=Path(tmp) / "weights")
            disk_s, disk_bytes = timed_pushes(disk, module, args.repeats)
            dist_sync = DistributedSync(
                client, cfg.model.arch, stage=0, make_client=lambda: client, timeout_s=600
            )
            dist_s, dist_bytes = timed_pushes(dist_sync, module, args.repeats)
            dist_sync.close()
            tensor = TensorSync(client, cfg.model.arch, bucket_bytes=args.bucket_mb * 1024**2)
            tensor_s, tensor_bytes = timed_pushes(tensor, module, args.repeats)
            # rollout.colocation time_shared's form: one flattened bucket per dtype
            client.control.flatten_buckets = True
            flat_s, flat_bytes = timed_pushes(tensor, module, args.repeats)
    print(
        f"Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts: {model_mb:.0f} MB fp32"
    )
    arms = (
        ("disk", disk_s, disk_bytes),
        ("distributed", dist_s, dist_bytes),
        ("tensor", tensor_s, tensor_bytes),
        ("tensor-flat", flat_s, flat_bytes),
    )
    for name, seconds, sent in arms:
        print(f"{name:12s} {seconds:6.2f} s/sync  {sent / 1e6:7.0f} MB  {sent / 1e6 / seconds:6.0f} MB/s")
    print(
        f"ratio distributed / disk: {dist_s / disk_s:.2f}; tensor ({args.bucket_mb} MiB buckets) / disk: "
        f"{tensor_s / disk_s:.2f}; flattened / disk: {flat_s / disk_s:.2f}"
    )


if __name__ == "__main__":
    main()
