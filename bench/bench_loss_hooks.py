"""Time of the SAPO loss hook against the GRPO hook (and GSPO, for reference) on the same inputs.

Two measurements, each the median over repetitions run round-robin (so drifting machine load hits every
variant alike), ratios against GRPO measured in the same run:

1. the whole hook, forward + backward: vocab-parallel log-probs + entropy from ``[b, s, V]`` logits (Qwen3's
   vocabulary), the policy loss with TIS, the metrics – what a training step pays per micro-batch;
2. the policy-loss math alone (``loss.compute`` on ``[b, s]`` log-probs, forward + backward), where the soft
   gate and the hard clip differ.

    python bench/bench_loss_hooks.py
    python bench/bench_loss_hooks.py --tokens 2048 --dtype fp32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch

from sapo_megatron.algo import TIS, build_policy_loss
from sapo_megatron.megatron.loss_hook import PolicyLossHook, add_global_normalisers

LOSSES = {"grpo": {"name": "grpo"}, "sapo": {"name": "sapo"}, "gspo": {"name": "gspo"}}
BASELINE = "grpo"


def make_batch(batch: int, seq: int, vocab: int | None, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seq)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=gen)
    mask = torch.arange(seq) < lengths[:, None]
    logp = -torch.rand(shape, generator=gen) * 3.0
    old = logp + 0.2 * torch.randn(shape, generator=gen)
    data = {
        "loss_mask": mask.long(),
        "advantages": torch.randn(batch, generator=gen),
        "old_logp": old,
        "rollout_logp": old + 0.05 * torch.randn(shape, generator=gen),
        "logp": logp,
    }
    if vocab is not None:
        data["labels"] = torch.randint(0, vocab, shape, generator=gen)
    return data


def time_round_robin(fns: dict, reps: int) -> dict[str, float]:
    for fn in fns.values():  # warm-up
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def hook_fns(args) -> dict:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    batch = args.tokens // args.seq
    data = make_batch(batch, args.seq, args.vocab)
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(batch, args.seq, args.vocab, generator=gen) * 2.0).to(dtype)
    micro = add_global_normalisers([{k: v for k, v in data.items() if k != "logp"}], dp_group=None)[0]

    def run(hook):
        leaf = logits.clone().requires_grad_()
        loss, _ = hook(leaf * 1, micro)  # a non-leaf, as model logits are: the in-place backward applies
        loss.backward()

    hooks = {
        name: PolicyLossHook(cfg, TIS(cap=2.0), tp_group=None, chunk_tokens=args.chunk_tokens)
        for name, cfg in LOSSES.items()
    }
    return {name: (lambda h=h: run(h)) for name, h in hooks.items()}


def math_fns(args) -> dict:
    data = make_batch(args.math_batch, args.math_seq, None)
    mask = data["loss_mask"]
    num_seq, num_tok = mask.any(-1).sum(), mask.sum()

    def run(loss_cfg):
        logp = data["logp"].clone().requires_grad_()
        loss, _ = loss_cfg.compute(
            logp,
            data["old_logp"],
            data["advantages"],
            mask,
            rollout_logp_bt=data["rollout_logp"],
            correction=TIS(cap=2.0),
            num_sequences=num_seq,
            num_tokens=num_tok,
        )
        loss.backward()

    losses = {name: build_policy_loss(cfg) for name, cfg in LOSSES.items()}
    return {name: (lambda c=c: run(c)) for name, c in losses.items()}


def report(title: str, medians: dict[str, float]) -> None:
    print(title)
    base = medians[BASELINE]
    for name, seconds in medians.items():
        print(f"  {name:<6}{seconds * 1e3:>10.1f} ms   ratio vs {BASELINE}: {seconds / base:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per micro-batch (hook benchmark)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--math-batch", type=int, default=64)
    parser.add_argument("--math-seq", type=int, default=4096)
    parser.add_argument("--math-reps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians, round-robin repetitions\n")
    report(
        f"hook forward+backward: {args.tokens} tokens × vocab {args.vocab}, {args.dtype} logits, "
        f"chunk {args.chunk_tokens}, TIS, {args.reps} reps",
        time_round_robin(hook_fns(args), args.reps),
    )
    print()
    report(
        f"policy-loss math forward+backward: [{args.math_batch} × {args.math_seq}] fp32, TIS, "
        f"{args.math_reps} reps",
        time_round_robin(math_fns(args), args.math_reps),
    )


if __name__ == "__main__":
    main()
