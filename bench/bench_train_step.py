"""Per-step time of a tiny Qwen3-MoE training step on Megatron (TrainEngine, CPU/gloo compat layer) against the
same model in HF transformers (forward + backward + Adam), measured in the same run.

    python bench/bench_train_step.py [--batch 8] [--seq 128] [--steps 20] [--threads 1]

Prints milliseconds per step for both and the ratio Megatron / transformers (lower is better).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def time_steps(step, steps: int) -> float:
    for _ in range(3):
        step()
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def hf_step_fn(hf_dir: Path, ids: torch.Tensor):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad()
        model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss.backward()
        optimizer.step()

    return step


def megatron_step_fn(hf_dir: Path, ids: torch.Tensor):
    from sapo_megatron.config import config_from_dict
    from sapo_megatron.megatron.parallel import init_parallel
    from sapo_megatron.megatron.sft import sft_loss
    from sapo_megatron.megatron.train_step import TrainEngine

    cfg = config_from_dict({"model": {"hf_config": str(hf_dir), "init": "hf", "init_path": str(hf_dir)}})
    init_parallel(cfg.parallel, seed=0)
    engine = TrainEngine(cfg)
    mask = torch.ones_like(ids[:, 1:], dtype=torch.float32)
    batch = [
        {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask, "num_tokens_global": mask.sum()}
    ]
    return lambda: engine.train_step(batch, sft_loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from sapo_megatron.model.tiny import make_tiny_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_tiny_hf_checkpoint(Path(tmp) / "moe", "moe", seed=0, hidden_size=64, head_dim=16)
        ids = torch.randint(0, 64, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
        hf_ms = time_steps(hf_step_fn(hf_dir, ids), args.steps)
        megatron_ms = time_steps(megatron_step_fn(hf_dir, ids), args.steps)
    print(
        f"tiny Qwen3-MoE (2 layers, hidden 64, 8 experts top-2), batch {args.batch} x {args.seq}, {args.threads} thread(s)"
    )
    print(f"transformers fwd+bwd+adam: {hf_ms:.1f} ms/step (median of {args.steps})")
    print(f"megatron TrainEngine step: {megatron_ms:.1f} ms/step")
    print(f"ratio megatron / transformers: {megatron_ms / hf_ms:.2f}")


if __name__ == "__main__":
    main()
