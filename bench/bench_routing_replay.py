"""Overhead of MoE routing replay on the tiny Qwen3-MoE: the training step with R3 replay (engine routes) against
the same step with live routing, and the old-log-prob pass with route recording (R2) against without, measured
in one run on one engine (steps alternate, medians compared). Also prints the route bytes per token.

    python bench/bench_routing_replay.py [--batch 16] [--seq 256] [--micro-batches 2] [--steps 15] [--threads 1]

Goal: R3 step / plain step ≤ 1.1.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

QWEN3_30B_A3B = {"num_layers": 48, "top_k": 8}  # for the bytes-per-token line


def sequences(layout, count: int, seq: int, seed: int):
    """Prompt + response of ``seq + 1`` tokens each, with random valid engine routes."""
    from sapo_megatron.model.batching import TrainSequence

    gen = np.random.default_rng(seed)
    out = []
    for i in range(count):
        prompt, response = gen.integers(1, 64, 16).tolist(), gen.integers(1, 64, seq - 15).tolist()
        noise = gen.random((seq, layout.num_layers, layout.num_experts))
        routes = np.argsort(noise, axis=-1)[..., : layout.top_k].astype(np.int32)
        out.append(TrainSequence(prompt, response, advantage=1.0, routed_experts=routes, sample_id=f"s{i}"))
    return out


def build_engine(hf_dir: Path):
    from sapo_megatron.config import config_from_dict
    from sapo_megatron.megatron.parallel import init_parallel
    from sapo_megatron.megatron.train_step import TrainEngine

    cfg = config_from_dict(
        {
            "model": {"hf_config": str(hf_dir), "init": "hf", "init_path": str(hf_dir)},
            "optimizer": {"lr": 1e-5},
        }
    )
    init_parallel(cfg.parallel, seed=0)
    return cfg, TrainEngine(cfg, routing_replay=True, total_steps=1000)


def time_alternating(fns: dict[str, callable], steps: int) -> dict[str, float]:
    """Median milliseconds per call of each function, calls interleaved so drift hits all alike."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from sapo_megatron.megatron.loss_hook import LogprobOutput
    from sapo_megatron.megatron.sft import sft_loss
    from sapo_megatron.model.batching import RouteLayout, build_micro_batches
    from sapo_megatron.model.tiny import make_tiny_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_tiny_hf_checkpoint(
            Path(tmp) / "moe", "moe", seed=0, hidden_size=64, head_dim=16, num_hidden_layers=4
        )
        cfg, engine = build_engine(hf_dir)
    layout = RouteLayout.from_arch(cfg.model.arch)
    seqs = sequences(layout, args.batch, args.seq, seed=0)

    def micro(with_routes: bool):
        batches = build_micro_batches(
            seqs,
            dp_rank=0,
            dp_size=1,
            micro_batches=args.micro_batches,
            pad_id=0,
            route_layout=layout if with_routes else None,
        )
        total = sum(b["loss_mask"].sum() for b in batches)
        for b in batches:
            b["num_tokens_global"] = total
        return batches

    batches = micro(True)
    logp = LogprobOutput()
    times = time_alternating(
        {
            "step": lambda: engine.train_step(batches, sft_loss),
            "step_r3": lambda: engine.train_step(batches, sft_loss, replay_key="engine_routes"),
            "old_logp": lambda: engine.forward_only(batches, logp),
            "old_logp_record": lambda: engine.forward_only(batches, logp, record_routes=True),
            "build": lambda: micro(False),
            "build_routes": lambda: micro(True),
        },
        args.steps,
    )
    tokens = args.batch * args.seq
    route_bytes = layout.num_layers * layout.top_k * 4
    big = QWEN3_30B_A3B["num_layers"] * QWEN3_30B_A3B["top_k"] * 4
    print(
        f"tiny Qwen3-MoE ({layout.num_layers} layers, hidden 64, {layout.num_experts} experts top-{layout.top_k}), "
        f"batch {args.batch} x {args.seq} in {args.micro_batches} micro-batches, {args.threads} thread(s), "
        f"median of {args.steps}"
    )
    print(f"train step, live routing:     {times['step']:.1f} ms")
    print(f"train step, R3 replay:        {times['step_r3']:.1f} ms")
    print(f"ratio R3 / live:              {times['step_r3'] / times['step']:.3f}  (goal <= 1.1)")
    print(f"old-logp pass:                {times['old_logp']:.1f} ms")
    print(f"old-logp pass + R2 recording: {times['old_logp_record']:.1f} ms")
    print(f"ratio recording / plain:      {times['old_logp_record'] / times['old_logp']:.3f}")
    print(f"micro-batches without/with routes: {times['build']:.2f} / {times['build_routes']:.2f} ms")
    print(
        f"route bytes per token (int32 [L, k]): {route_bytes} here, {big} for Qwen3-30B-A3B (48 layers, top-8); "
        f"this batch: {route_bytes * tokens / 1024:.0f} KiB"
    )


if __name__ == "__main__":
    main()
