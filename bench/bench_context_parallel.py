"""Context parallelism on CPU: peak activation memory and step time of one long sequence at cp 1 vs cp 2.

One forward + backward of a Qwen3-MoE-shaped model (Megatron's local spec, fp32; hidden 256, 8 q / 2 kv heads ×
32, 16 experts top-4, vocab 2048) on one sequence of ``--seq`` tokens, through the path a training step takes:
``model_inputs`` (cp 2: this rank's two chunks, the CP attention's mask and RoPE at global positions), the
vocab-parallel log-prob kernel on the local logits and the gather back into the whole sequence, ``sum(logp)`` as
the objective. cp 1 runs in one process, cp 2 on two gloo ranks.

- peak: the allocator's peak over forward + backward above the level before (torch profiler memory events), per
  rank; cp 2's worst rank against cp 1. Goal ≤ 0.55 (the sequence's activations split in two, plus what CP
  replicates: the gathered K/V of the layer being computed, whole-sequence log-probs).
- step time: the median of ``--repeats`` forward + backward passes without the profiler, cp 2 against cp 1.
  On CPU the two ranks share the machine's cores (and gloo moves the K/V through memory), so this ratio says
  little about GPUs, where CP ranks are separate devices and TE overlaps the K/V exchange with attention.

    python bench/bench_context_parallel.py [--seq 2048] [--layers 2] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2**20


def bench_config(cp: int, layers: int, seq: int):
    from sapo_megatron.config import config_from_dict
    from sapo_megatron.model.tiny import tiny_hf_config

    hf = tiny_hf_config(
        "moe",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=2048,
        max_position_embeddings=max(4096, seq),
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
    )
    return config_from_dict(
        {
            "model": {"hf_config": hf},
            "parallel": {"cp": cp},
            "launch": {"procs_per_node": cp},
            "rollout": {"n_samples": 1},
            "trainer": {"prompts_per_step": 1},
        }
    )


def one_step(model: torch.nn.Module, batch: dict) -> None:
    from sapo_megatron.megatron.activation_probe import _backward
    from sapo_megatron.megatron.context_parallel import batch_shards, gather_tokens, shard_tokens
    from sapo_megatron.megatron.logprobs import vocab_parallel_logprobs
    from sapo_megatron.megatron.packed_seq import model_inputs

    shards = batch_shards(batch)
    with model_inputs(model, batch) as inputs:
        logits = model(inputs.pop("input_ids", batch["input_ids"]), **inputs)
    logp, _ = vocab_parallel_logprobs(logits, shard_tokens(batch["labels"], shards), with_entropy=False)
    _backward(gather_tokens(logp, shards).sum())


def peak_bytes(fn) -> int:
    """The allocator's peak during ``fn`` above its level before (CPU: the profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def measure_rank(payload: dict) -> dict:
    from sapo_megatron.megatron.model import BuildOptions, build_gpt_model
    from sapo_megatron.megatron.parallel import init_parallel

    torch.set_num_threads(payload["threads"])
    cfg = bench_config(payload["cp"], payload["layers"], payload["seq"])
    init_parallel(cfg.parallel, seed=0)
    model = build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision))
    model.train()
    ids = torch.randint(0, 2048, (1, payload["seq"] + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    one_step(model, batch)  # warm-up: gradients allocated
    peak = peak_bytes(lambda: one_step(model, batch))
    seconds = []
    for _ in range(payload["repeats"]):
        torch.distributed.barrier()
        start = time.perf_counter()
        one_step(model, batch)
        seconds.append(time.perf_counter() - start)
    return {"peak": peak, "seconds": statistics.median(seconds)}


def run(cp: int, payload: dict) -> list[dict]:
    """Every rank's numbers at context-parallel size ``cp`` (fresh processes; tests/distributed.py hosts the store)."""
    from tests.distributed import run_distributed

    return run_distributed(
        "bench.bench_context_parallel:measure_rank", cp, {**payload, "cp": cp}, timeout=1800
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    payload = {"seq": args.seq, "layers": args.layers, "threads": args.threads, "repeats": args.repeats}
    one, two = run(1, payload)[0], run(2, payload)
    worst = max(r["peak"] for r in two)
    slowest = max(r["seconds"] for r in two)
    print(f"one sequence of {args.seq} tokens, {args.layers} layers, fp32, {args.threads} thread(s) per rank")
    print(f"{'':>6} {'peak MiB':>10} {'step s':>8}")
    print(f"{'cp 1':>6} {one['peak'] / MIB:>10.1f} {one['seconds']:>8.3f}")
    for rank, r in enumerate(two):
        print(f"{f'cp 2/{rank}':>6} {r['peak'] / MIB:>10.1f} {r['seconds']:>8.3f}")
    ratio = worst / one["peak"]
    print(
        f"peak ratio cp2/cp1 (worst rank): {ratio:.3f} (goal <= 0.55: {'met' if ratio <= 0.55 else 'NOT met'})"
    )
    print(f"step-time ratio cp2/cp1 (slowest rank): {slowest / one['seconds']:.3f}")


if __name__ == "__main__":
    main()
