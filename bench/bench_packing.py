"""Packed against right-padded micro-batches on an RL-like length distribution, measured in the same run: the
fraction of the tokens the model runs that are padding, and the time of one RL update (old-log-prob pass + SAPO
policy step) on a tiny Qwen3-MoE (TrainEngine, CPU/gloo compat layer, local spec).

    python bench/bench_packing.py [--samples 32] [--micro-batches 4] [--budgets 0,2048] [--steps 3]
                                  [--threads 1] [--hidden 128]

Responses are log-normal (median 150 tokens, sigma 0.9, capped at 1024: many short ones, a few long ones, as RL
rollouts are), prompts uniform in [32, 128]. Per layout: micro-batches, tokens run, padding fraction, the
query-key pairs a dense masked attention computes (rows × T² per micro-batch) and ms per update; then the ratios
packed / padded and the largest log-prob difference (the layouts compute the same thing). On CPU the packed rows
run with a block-diagonal mask, so attention still spans each whole row; THD on GPU computes only the pairs
within each sequence (printed as a ratio too), so the CPU step-time ratio understates the GPU's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


def rl_lengths(samples: int, seed: int) -> list[tuple[int, int]]:
    gen = np.random.default_rng(seed)
    responses = np.minimum(gen.lognormal(np.log(150), 0.9, size=samples).astype(int) + 1, 1024)
    prompts = gen.integers(32, 129, size=samples)
    return list(zip(prompts.tolist(), responses.tolist()))


def sequences(lengths: list[tuple[int, int]], seed: int):
    from sapo_megatron.model.batching import TrainSequence

    gen = np.random.default_rng(seed)
    return [
        TrainSequence(
            gen.integers(1, 64, size=p).tolist(),
            gen.integers(1, 64, size=r).tolist(),
            advantage=float(gen.uniform(-1, 1)),
            token_values={"noise": (0.1 * gen.standard_normal(r)).tolist()},
        )
        for p, r in lengths
    ]


def padded_fraction(micro: list[dict], lengths: list[tuple[int, int]]) -> tuple[float, int]:
    """(padding / tokens run, tokens run); a sequence's real tokens are its ``P + R - 1`` model positions."""
    from sapo_megatron.model.batching import SEQUENCE_INDEX

    run = sum(b["input_ids"].numel() for b in micro)
    real = sum(lengths[i][0] + lengths[i][1] - 1 for b in micro for i in b[SEQUENCE_INDEX].tolist())
    return 1.0 - real / run, run


def update_fn(engine, micro: list[dict]):
    from sapo_megatron.megatron.loss_hook import LogprobOutput, PolicyLossHook, add_global_normalisers

    micro = add_global_normalisers(micro)
    hook = PolicyLossHook({"name": "sapo"})
    out: dict = {}

    def update() -> None:
        logp = engine.forward_only(micro, LogprobOutput())
        for batch, value in zip(micro, logp):
            batch["old_logp"] = value + batch["noise"]
        engine.train_step(micro, hook)
        out.setdefault("logp", logp)  # the first call's: both layouts start from the same weights

    return update, out


def time_update(update, steps: int) -> tuple[float, float]:
    """Median (wall ms, CPU ms of this process) per update; CPU time is what a shared machine cannot inflate."""
    update()  # warm-up (first-call allocations, the router's compiled path)
    wall, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        update()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def per_sequence_logp(micro: list[dict], logp: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    from sapo_megatron.model.batching import SEQUENCE_INDEX
    from sapo_megatron.model.packing import SequenceView

    out = {}
    for batch, value in zip(micro, logp):
        view = SequenceView(batch)
        rows, mask = view(value), view(batch["loss_mask"]).bool()
        for row, index in enumerate(batch[SEQUENCE_INDEX].tolist()):
            out[index] = rows[row][mask[row]]
    return out


@dataclass
class Layout:
    """One layout's measurements."""

    name: str
    micro_batches: int
    tokens_run: int
    padding: float
    dense_attention: int  # query-key pairs a dense (masked) attention computes: rows × T² per micro-batch
    ms: float
    cpu_ms: float
    logp: dict[int, torch.Tensor]


def attention_pairs(micro: list[dict]) -> int:
    return sum(b["input_ids"].shape[0] * b["input_ids"].shape[1] ** 2 for b in micro)


def measure(engine, initial, seqs, lengths, name: str, budget: int | None, args) -> Layout:
    from sapo_megatron.model.batching import build_micro_batches

    micro = build_micro_batches(
        seqs,
        dp_rank=0,
        dp_size=1,
        micro_batches=args.micro_batches,
        pad_id=0,
        max_tokens_per_micro_batch=budget,
    )
    engine.module.load_state_dict(initial, strict=False)
    update, out = update_fn(engine, micro)
    ms, cpu_ms = time_update(update, args.steps)
    padding, run = padded_fraction(micro, lengths)
    return Layout(
        name,
        len(micro),
        run,
        padding,
        attention_pairs(micro),
        ms,
        cpu_ms,
        per_sequence_logp(micro, out["logp"]),
    )


def build_engine(tmp: str, hidden: int):
    from sapo_megatron.config import config_from_dict
    from sapo_megatron.megatron.parallel import init_parallel
    from sapo_megatron.megatron.train_step import TrainEngine
    from sapo_megatron.model.tiny import make_tiny_hf_checkpoint

    hf = str(
        make_tiny_hf_checkpoint(
            Path(tmp) / "moe",
            "moe",
            seed=0,
            hidden_size=hidden,
            head_dim=hidden // 4,
            intermediate_size=2 * hidden,
            moe_intermediate_size=hidden,
            max_position_embeddings=4096,
        )
    )
    cfg = config_from_dict(
        {"model": {"hf_config": hf, "init": "hf", "init_path": hf}, "optimizer": {"name": "sgd", "lr": 1e-3}}
    )
    init_parallel(cfg.parallel, seed=0)
    return TrainEngine(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument(
        "--micro-batches", type=int, default=4, help="padded layout (packed: at least this many)"
    )
    parser.add_argument(
        "--budgets",
        default="0,2048",
        help="parallel.max_tokens_per_micro_batch values; 0: the longest sequence (the tightest budget)",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hidden", type=int, default=128, help="model width (4 heads of hidden/4, 8 experts)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths = rl_lengths(args.samples, args.seed)
    seqs = sequences(lengths, args.seed)
    longest = max(p + r - 1 for p, r in lengths)
    budgets = [int(b) or longest for b in args.budgets.split(",")]
    thd_pairs = sum((p + r - 1) ** 2 for p, r in lengths)  # THD attends within each sequence only
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(tmp, args.hidden)
        initial = {k: v.clone() for k, v in engine.module.state_dict().items() if isinstance(v, torch.Tensor)}
        padded = measure(engine, initial, seqs, lengths, "padded", None, args)
        packed = [measure(engine, initial, seqs, lengths, f"packed {b}", b, args) for b in budgets]
    responses = [r for _, r in lengths]
    print(
        f"{args.samples} sequences: responses log-normal (median {int(np.median(responses))}, max {max(responses)}), "
        f"prompts 32-128, longest sequence {longest}; tiny Qwen3-MoE (hidden {args.hidden}), {args.threads} "
        f"thread(s), median of {args.steps} updates (old-log-prob pass + SAPO step)"
    )
    header = ("layout", "micro-batches", "tokens run", "padding", "dense attn pairs", "ms/update", "CPU ms")
    print("{:>12} {:>13} {:>10} {:>8} {:>16} {:>10} {:>9}".format(*header))
    for row in (padded, *packed):
        print(
            f"{row.name:>12} {row.micro_batches:13d} {row.tokens_run:10d} {row.padding:8.1%} "
            f"{row.dense_attention:16d} {row.ms:10.1f} {row.cpu_ms:9.1f}"
        )
    print(
        f"THD (GPU) attends within each sequence: {thd_pairs / padded.dense_attention:.2f} of the padded pairs"
    )
    for row in packed:
        worst = max(float((padded.logp[i] - row.logp[i]).abs().max()) for i in padded.logp)
        print(
            f"ratio {row.name} / padded: tokens run {row.tokens_run / padded.tokens_run:.2f}, "
            f"dense attention pairs {row.dense_attention / padded.dense_attention:.2f}, "
            f"step time {row.ms / padded.ms:.2f} (CPU time {row.cpu_ms / padded.cpu_ms:.2f}); max |Δ logp| {worst:.1e}"
        )


if __name__ == "__main__":
    main()
