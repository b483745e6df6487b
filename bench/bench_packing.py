"""Packed against right-padded micro-batches on an RL-like length distribution, measured in the same run: the
fraction of the tokens the model runs that are padding, and the time of one RL update (old-log-prob pass +
SAPO policy step) on a tiny Qwen3-MoE (TrainEngine, CPU/gloo compat layer, local spec: the packed rows run with
a block-diagonal mask, so attention still spans each whole row – a THD kernel on GPU skips those blocks too).

    python bench/bench_packing.py [--samples 64] [--micro-batches 4] [--budget 2048] [--steps 5] [--threads 2]

Responses are log-normal (median 150 tokens, sigma 0.9, capped at 1024: a few long ones, many short ones, as RL
rollouts are), prompts uniform in [32, 128]. Prints both layouts' padded fraction and ms per update, the
ratio packed / padded, and the largest log-prob difference between the two (they compute the same thing).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def rl_lengths(samples: int, seed: int) -> list[tuple[int, int]]:
    gen = np.random.default_rng(seed)
    responses = np.minimum(gen.lognormal(np.log(150), 0.9, size=samples).astype(int) + 1, 1024)
    prompts = gen.integers(32, 129, size=samples)
    return list(zip(prompts.tolist(), responses.tolist()))


def sequences(lengths: list[tuple[int, int]], seed: int):
    from sapo_megatron.batching import TrainSequence

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
    from sapo_megatron.batching import SEQUENCE_INDEX

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


def time_update(update, steps: int) -> float:
    update()  # warm-up (first-call allocations, the router's compiled path)
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        update()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def per_sequence_logp(micro: list[dict], logp: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    from sapo_megatron.batching import SEQUENCE_INDEX
    from sapo_megatron.packing import SequenceView

    out = {}
    for batch, value in zip(micro, logp):
        view = SequenceView(batch)
        rows, mask = view(value), view(batch["loss_mask"]).bool()
        for row, index in enumerate(batch[SEQUENCE_INDEX].tolist()):
            out[index] = rows[row][mask[row]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument(
        "--micro-batches", type=int, default=4, help="padded layout (packed: at least this many)"
    )
    parser.add_argument("--budget", type=int, default=2048, help="parallel.max_tokens_per_micro_batch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from sapo_megatron.batching import build_micro_batches
    from sapo_megatron.config import config_from_dict
    from sapo_megatron.megatron.parallel import init_parallel
    from sapo_megatron.megatron.train_step import TrainEngine
    from sapo_megatron.tiny import make_tiny_hf_checkpoint

    lengths = rl_lengths(args.samples, args.seed)
    seqs = sequences(lengths, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_tiny_hf_checkpoint(Path(tmp) / "moe", "moe", seed=0, hidden_size=64, head_dim=16)
        hf = str(hf_dir)
        cfg = config_from_dict(
            {
                "model": {"hf_config": hf, "init": "hf", "init_path": hf},
                "optimizer": {"name": "sgd", "lr": 1e-3},
            }
        )
        init_parallel(cfg.parallel, seed=0)
        engine = TrainEngine(cfg)
        initial = {k: v.clone() for k, v in engine.module.state_dict().items() if isinstance(v, torch.Tensor)}
        results = {}
        for name, budget in (("padded", None), ("packed", args.budget)):
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
            ms = time_update(update, args.steps)
            results[name] = (
                *padded_fraction(micro, lengths),
                ms,
                len(micro),
                per_sequence_logp(micro, out["logp"]),
            )
    responses = [r for _, r in lengths]
    print(
        f"{args.samples} sequences: responses log-normal (median {int(np.median(responses))}, max {max(responses)}), "
        f"prompts 32-128; tiny Qwen3-MoE, {args.threads} thread(s), median of {args.steps} updates"
    )
    for name, (fraction, run, ms, count, _) in results.items():
        print(
            f"{name:>6}: {count:2d} micro-batches, {run:6d} tokens run, {fraction:6.1%} padding, {ms:8.1f} ms/update"
        )
    pad, pack = results["padded"], results["packed"]
    worst = max(float((pad[4][i] - pack[4][i]).abs().max()) for i in pad[4])
    print(f"ratio packed / padded: tokens run {pack[1] / pad[1]:.2f}, step time {pack[2] / pad[2]:.2f}")
    print(f"max |logp packed - logp padded| (first old-log-prob pass): {worst:.2e}")


if __name__ == "__main__":
    main()
