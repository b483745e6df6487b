"""Peak extra memory and time of the chunked vocab-parallel log-prob + entropy (forward + backward) against a
naive full-vocabulary ``log_softmax`` + entropy, at Qwen3's vocabulary (151,936).

Method (CPU): every variant runs in a fresh subprocess. The logits (and a pristine copy to restore them) are
allocated and touched first, a small warm-up runs, then for each repetition the kernel's peak-RSS counter is
reset (``echo 5 > /proc/self/clear_refs``) and ``VmHWM − VmRSS_before`` after forward + backward is the peak
extra memory: every byte the computation allocated and touched on top of the logits, the gradient wrt the
logits included (both variants must produce it). glibc serves these large tensors with mmap and returns them
on free, so the RSS high-water mark is the allocator peak. Time is the minimum over repetitions.
On a GPU (``--device cuda``) the same is read from the CUDA caching allocator
(``max_memory_allocated − memory_allocated`` after ``reset_peak_memory_stats``), with synchronised timing.

    python bench/bench_logprobs.py                       # 2,048 tokens, chunk 256, fp32 and bf16
    python bench/bench_logprobs.py --tokens 4096 --chunk-tokens 512
    python bench/bench_logprobs.py --device cuda --tokens 16384 --chunk-tokens 1024
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

VOCAB = 151_936
VARIANTS = ("naive", "chunked", "chunked-inplace")


def _status_mib(key: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1)) / 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


class _Meter:
    """Peak extra memory (MiB) of the code run between ``start`` and ``stop``, and its wall time."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch, self.cuda = torch, device == "cuda"

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def start(self) -> None:
        self._sync()
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
            self.before = self.torch.cuda.memory_allocated() / 2**20
        else:
            _reset_peak()
            self.before = _status_mib("VmRSS")
        self.t0 = time.perf_counter()

    def stop(self) -> tuple[float, float]:
        self._sync()
        seconds = time.perf_counter() - self.t0
        peak = self.torch.cuda.max_memory_allocated() / 2**20 if self.cuda else _status_mib("VmHWM")
        return seconds, peak - self.before


def _worker(args) -> dict:
    import torch

    from sapo_megatron.megatron.logprobs import vocab_parallel_logprobs

    variant, tokens, vocab, chunk, reps = args.worker, args.tokens, args.vocab, args.chunk_tokens, args.reps
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    gen = torch.Generator().manual_seed(0)
    pristine = (torch.randn(tokens, vocab, generator=gen) * 2.0).to(dtype).to(args.device)
    labels = torch.randint(0, vocab, (tokens,), generator=gen).to(args.device)
    g_logp = torch.randn(tokens, generator=gen).to(args.device)
    g_ent = torch.randn(tokens, generator=gen).to(args.device)

    def naive(z, y):
        lsm = torch.log_softmax(z.float(), dim=-1)
        return lsm.gather(-1, y[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)

    def chunked(z, y, inplace):
        return vocab_parallel_logprobs(z, y, tp_group=None, chunk_tokens=chunk, inplace_backward=inplace)

    fn = {
        "naive": naive,
        "chunked": lambda z, y: chunked(z, y, False),
        "chunked-inplace": lambda z, y: chunked(z, y, True),
    }[variant]

    def step(z):
        n = z.shape[0]
        logp, entropy = fn(z, labels[:n])
        ((logp * g_logp[:n]).sum() + (entropy * g_ent[:n]).sum()).backward()

    # Warm-up on a slice (kernels, thread pool), so that the measured repetitions see a steady state.
    step(pristine[: min(chunk, tokens)].clone().requires_grad_())
    # A non-leaf view, as a model's logits are: in-place backward then never aliases a leaf's .grad.
    leaf = pristine.clone().requires_grad_()
    meter, times, peaks = _Meter(args.device), [], []
    for _ in range(reps):
        leaf.grad = None
        with torch.no_grad():
            leaf.copy_(pristine)
        logits = leaf.view_as(leaf)
        meter.start()
        step(logits)
        seconds, peak = meter.stop()
        times.append(seconds)
        peaks.append(peak)
        del logits
    return {"time_s": min(times), "peak_extra_mib": max(peaks)}


def _run_variant(args, variant: str, dtype: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--dtype",
        dtype,
        "--tokens",
        str(args.tokens),
        "--vocab",
        str(args.vocab),
        "--chunk-tokens",
        str(args.chunk_tokens),
        "--reps",
        str(args.reps),
        "--device",
        args.device,
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--dtype", default="fp32")
    args = parser.parse_args()
    if args.worker:
        result = _worker(args)
        print(json.dumps(result))
        return

    full_fp32_mib = args.tokens * args.vocab * 4 / 2**20
    print(
        f"log-prob + entropy, forward + backward: {args.tokens} tokens × vocab {args.vocab} "
        f"(one fp32 [tokens × vocab] = {full_fp32_mib:.0f} MiB), chunk {args.chunk_tokens} tokens, "
        f"{args.device} ({os.cpu_count()} CPU cores), min of {args.reps} reps"
    )
    if args.device == "cpu":
        print("peak extra memory = VmHWM − VmRSS over forward+backward (reset via /proc/self/clear_refs),")
    else:
        print("peak extra memory = CUDA max_memory_allocated − memory_allocated over forward+backward,")
    print("fresh subprocess per variant; includes the gradient wrt the logits.\n")
    header = (
        f"{'dtype':<6}{'variant':<17}{'peak extra MiB':>15}{'time s':>9}{'mem ratio':>11}{'time ratio':>12}"
    )
    print(header)
    print("-" * len(header))
    for dtype in args.dtypes.split(","):
        base = None
        for variant in VARIANTS:
            r = _run_variant(args, variant, dtype)
            base = base or r
            print(
                f"{dtype:<6}{variant:<17}{r['peak_extra_mib']:>15.0f}{r['time_s']:>9.2f}"
                f"{r['peak_extra_mib'] / base['peak_extra_mib']:>11.3f}{r['time_s'] / base['time_s']:>12.3f}"
            )
    print(
        "\nratios are against the naive variant of the same dtype, measured in this run; goal: memory ≤ 0.25 at time ≤ 1.2"
    )


if __name__ == "__main__":
    main()
