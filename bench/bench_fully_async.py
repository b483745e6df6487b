"""Samples per second and the trainer's idle share under ``trainer.rollout_mode`` sync, one_step_off and fully_async
(``max_staleness`` 1, 2, 4), each measured in the same run, with heavy-tailed response lengths.

    python bench/bench_fully_async.py [--steps 16] [--prompts 4] [--median 6] [--sigma 1.264] [--cap 96]
                                      [--train-ratio 1.0 | --train-tokens-per-s T] [--chunk 4] [--rounds 2]
                                      [--inflight 1 [4 8x1 ...]] [--engine cpu-server|sglang] [--static-batches]

Generation is real: the CPU rollout server (``sapo-megatron serve``, the stand-in for an SGLang worker, its own
process, one torch thread) behind :class:`~sapo_megatron.rollout.sglang.client.SGLangClient`, a tiny random
Qwen3-MoE whose responses run to their ``max_new_tokens`` (no stop token). Each sample's length is drawn from a
lognormal with median ``--median`` and ``--sigma`` (1.264: 5 % of samples ≥ 8× the median), capped at ``--cap``;
the lengths are one fixed sequence, so every arm generates the same samples' lengths in the same order. The server
batches continuously, as SGLang does: a request joins the running batch between decode steps and is answered as
soon as it ends, so a chunk's short samples come back while its long ones still run (``--static-batches``: the
server's static batches instead, where every request waits for its batch's longest sample). A synchronous step
still waits for its longest sample. ``--engine sglang``: a real SGLang 0.5.23 server on CPU instead (bench/real_sglang.py,
as tests/sglang_real starts it: float32, one thread, continuous batching; the demo's architecture widened to
``--hidden``, no EOS); its start (1-3 minutes) is not timed.

``--inflight K[xC] ...``: the fully_async arms' producer keeps up to K chunks (of C groups, default ``--chunk``) in
flight (``trainer.async_inflight_chunks``, ``trainer.async_chunk_groups``), each entering the buffer when it
finishes – with continuous batching, short samples reach the trainer while long ones keep generating. Each value
gets its own fully_async arms (named ``fully_async_<max_staleness>_k<K>[c<C>]``, plain for K = 1 with ``--chunk``),
measured in the same run as the others.

The trainer is simulated: a step sleeps ``trained tokens / --train-tokens-per-s`` seconds (by default calibrated so
that training takes ``--train-ratio`` times as long as generating, where asynchrony matters most; equal trained
samples in every arm – and tokens, with one chunk in flight: chunks finishing out of order change which samples a
step trains; a sleep leaves the CPU to the server, as a trainer on its own GPUs would), and a weight update sleeps
``--sync-s``. The arms run the project's own pipelines (:class:`~sapo_megatron.loop.pipeline.RolloutPipeline`,
:class:`~sapo_megatron.loop.fully_async.FullyAsyncPipeline` with its producer thread and ``--chunk`` groups per
generation call), so what is measured is the schedule of each mode against real generation. Printed per arm:
trained tokens and tokens/s, samples/s over the steps (after the first), the trainer's idle share (time not in the simulated step / wall
time), the share of wall time the server was generating for the arm, the mean token staleness, and the ratios to
sync and to one_step_off; each the mean of ``--rounds`` runs, the arms' order reversed every other round.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def lengths(count: int, *, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(1, min(cap, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))) for _ in range(count)]


class SimulatedSync:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def push(self, module: Any) -> dict[str, float]:
        time.sleep(self.seconds)
        return {}


def make_generate(client, draws: list[int], args):
    """``generate(index, groups)`` as the trainer's: ``groups`` one-sample groups of the next lengths in ``draws``."""
    from sapo_megatron.model.batching import TrainSequence
    from sapo_megatron.rollout.types import GenerationRequest, SamplingParams

    position = [0]
    busy = [0.0]  # seconds in which at least one generate call was in the server (chunks run concurrently)
    calls = [0, 0.0]  # generate calls in flight, when the first of them began
    lock = threading.Lock()

    def timed(begin: bool) -> None:
        with lock:
            now = time.perf_counter()
            if begin:
                calls[0] += 1
                if calls[0] == 1:
                    calls[1] = now
            else:
                calls[0] -= 1
                if calls[0] == 0:
                    busy[0] += now - calls[1]

    def generate(index: int, groups: int):
        with lock:  # concurrent chunks take the next lengths in turn
            take = draws[position[0] : position[0] + groups]
            if len(take) < groups:  # never loop on empty chunks: say what ran out
                raise RuntimeError(f"the arm drew more than the {len(draws)} prepared response lengths")
            position[0] += groups
        requests = [
            GenerationRequest(
                prompt_ids=[5, 6, 7, 8],
                n=1,
                group_id=i,
                sampling=SamplingParams(max_new_tokens=length, temperature=1.0, seed=index * 1000 + i),
            )
            for i, length in enumerate(take)
        ]
        timed(True)
        try:
            samples = [s for group in client.generate(requests) for s in group]
        finally:
            timed(False)
        # The simulated sync changes no weights, so the engine's own versions stay at its first for the whole run
        # (every group would look ever staler and be dropped): no per-token versions, the pipeline tags each group
        # with the policy version its chunk started at.
        sequences = [TrainSequence(s.prompt_ids, s.response_ids, 0.0, s.rollout_logp) for s in samples]
        return sequences, {}, {}

    generate.busy = busy  # type: ignore[attr-defined]
    return generate


def calibrate(client, draws: list[int], args) -> float:
    """Generated tokens per second of the first 3 steps' batches, one batch at a time (as sync generates)."""
    generate = make_generate(client, draws, args)
    began = time.perf_counter()
    tokens = sum(len(s.response_ids) for index in range(3) for s in generate(index, args.prompts)[0])
    return tokens / (time.perf_counter() - began)


def run_arm(name: str, client, draws: list[int], args) -> dict[str, float]:
    from sapo_megatron.loop.fully_async import AsyncSettings, FullyAsyncPipeline
    from sapo_megatron.loop.pipeline import RolloutPipeline

    cfg = SimpleNamespace(rollout=SimpleNamespace(timeout_s=600.0))
    session = SimpleNamespace(
        cfg=cfg,
        info=SimpleNamespace(is_main=True),
        start=SimpleNamespace(resume=False, checkpoint=None),
        checkpointer=None,
        sync=SimpleNamespace(push=SimulatedSync(args.sync_s).push),
        # ``_pause`` arms: an update that cannot be deferred pauses the server (``--pause-mode``) instead of waiting
        # for the chunk in flight; the simulated sync changes no weights, so the tokens keep their chunk's version
        rollout=client if name.endswith("_pause") else None,
    )
    generate = make_generate(client, draws, args)
    if name.startswith("fully_async"):
        parts = name.split("_")
        staleness = int(parts[2])
        inflight, chunk = inflight_of(
            parts[3] if len(parts) > 3 and parts[3].startswith("k") else "", args.chunk
        )
        settings = AsyncSettings(
            groups_per_step=args.prompts,
            n_samples=1,
            max_staleness=staleness,
            stale_groups="drop",
            chunk_groups=chunk,
            capacity=(staleness + 1) * args.prompts,
            total_steps=args.steps,
            deterministic=False,
            pause_mode=args.pause_mode if name.endswith("_pause") else "none",
            inflight_chunks=inflight,
        )
        pipeline: Any = FullyAsyncPipeline(session, None, generate, settings, start_step=0)
    else:
        pipeline = RolloutPipeline(
            session,
            SimpleNamespace(load_state_dict=lambda state: None),
            lambda step: generate(step, args.prompts),
            start_step=0,
            total_steps=args.steps,
            overlap=name == "one_step_off",
        )
    busy = staleness_sum = gen_at_start = 0.0
    samples = trained_tokens = 0
    with pipeline:
        for step in range(args.steps):
            if step == 1:
                start, busy, gen_at_start = time.perf_counter(), 0.0, generate.busy[0]
            sequences, metrics = pipeline.next_batch(step)
            tokens = sum(len(s.response_ids) for s in sequences)
            began = time.perf_counter()
            time.sleep(tokens / args.train_tokens_per_s)  # the simulated trainer
            busy += time.perf_counter() - began
            pipeline.push_weights(None)
            if step >= 1:
                samples += len(sequences)
                trained_tokens += tokens
                staleness_sum += metrics.get("staleness/token_mean", 0.0)
    wall = time.perf_counter() - start
    return {
        "samples_per_s": samples / wall,
        "trainer_idle": 1.0 - busy / wall,
        "staleness": staleness_sum / (args.steps - 1),
        "wall_s": wall,
        "generating": (generate.busy[0] - gen_at_start) / wall,
        "tokens": trained_tokens,
    }


def inflight_of(tag: str, chunk: int) -> tuple[int, int]:
    """``(chunks in flight, groups per chunk)`` of an arm's ``k<K>[c<C>]`` tag ("": one chunk of ``chunk``)."""
    match = re.fullmatch(r"k(\d+)(?:c(\d+))?", tag)
    if match is None:
        return 1, chunk
    return int(match[1]), int(match[2] or chunk)


ENGINES = {"cpu-server": "the CPU server", "sglang": "real SGLang 0.5.23 (CPU)"}


@contextlib.contextmanager
def server_url(tmp: Path, arch: dict, args) -> Any:
    """The URL of the arms' server: the CPU server (its own process, one torch thread) or real SGLang on CPU."""
    if args.engine == "sglang":
        from bench.real_sglang import save_sglang_model, sglang_server

        if args.layers != 2:
            raise SystemExit("--engine sglang serves the demo's architecture (2 layers); leave --layers at 2")
        model = save_sglang_model(tmp / "model", args.hidden)
        with sglang_server(model, tmp / "sglang.log") as url:
            yield url
        return
    import torch
    import transformers

    from sapo_megatron.data.tokenizer import CharTokenizer
    from sapo_megatron.rollout.cpu.process import ServerProcess

    model_dir = tmp / "model"
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**arch)).save_pretrained(model_dir)
    CharTokenizer().save(model_dir)
    flags = ["--static-batches"] if args.static_batches else []
    server = ServerProcess("--model-path", str(model_dir), "--port", "0", "--threads", "1", *flags)
    try:
        yield server.url
    finally:
        server.stop(timeout_s=60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4, help="groups (one sample each) per step")
    parser.add_argument("--median", type=float, default=6.0, help="median response length (tokens)")
    parser.add_argument(
        "--sigma", type=float, default=1.264, help="lognormal sigma (1.264: 5%% >= 8x median)"
    )
    parser.add_argument("--cap", type=int, default=96, help="longest response (tokens)")
    parser.add_argument(
        "--train-tokens-per-s",
        type=float,
        default=None,
        help="the simulated trainer's speed (default: calibrated so that training a step takes --train-ratio times "
        "as long as generating it, measured on the first 3 steps' samples before the arms run)",
    )
    parser.add_argument("--train-ratio", type=float, default=1.0)
    parser.add_argument("--sync-s", type=float, default=0.05, help="the simulated weight update")
    parser.add_argument("--chunk", type=int, default=4, help="fully_async: groups per generation call")
    parser.add_argument(
        "--inflight",
        nargs="+",
        default=["1"],
        help="fully_async: K[xC]: K chunks (of C groups, default --chunk) in flight at once "
        "(trainer.async_inflight_chunks); several values: arms for each",
    )
    parser.add_argument(
        "--engine",
        choices=("cpu-server", "sglang"),
        default="cpu-server",
        help="the project's CPU server (continuous batching; --static-batches) or a real SGLang 0.5.23 server on CPU "
        "($SAPO_SGLANG_VENV, default /opt/sapo-sglang-venv)",
    )
    parser.add_argument(
        "--pause-mode",
        default="in_place",
        choices=["in_place", "retract", "abort", "none"],
        help="the fully_async_<k>_pause arms' trainer.pause_mode (none: no pause arms)",
    )
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="runs per arm, alternating the order")
    parser.add_argument(
        "--static-batches",
        action="store_true",
        help="the CPU server runs static batches, not continuous batching",
    )
    args = parser.parse_args()
    for value in args.inflight:
        if not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*)?", value):
            parser.error(f"--inflight takes K or KxC (K chunks of C groups, both >= 1), got {value!r}")

    from sapo_megatron.defaults import DEMO_MODEL
    from sapo_megatron.rollout.sglang.client import SGLangClient
    from sapo_megatron.rollout.types import GenerationRequest, SamplingParams

    arch = {**DEMO_MODEL, "hidden_size": args.hidden, "num_hidden_layers": args.layers}
    arch.update(intermediate_size=2 * args.hidden, moe_intermediate_size=args.hidden)
    arch["max_position_embeddings"] = max(64, 16 + args.cap)
    needed = args.steps * args.prompts + 8 * args.prompts  # fully_async may draw a few steps ahead
    draws = lengths(needed, median=args.median, sigma=args.sigma, cap=args.cap, seed=args.seed)
    ranked = sorted(draws)
    tail = sum(d >= 8 * args.median for d in draws) / len(draws)
    arms = ["sync", "one_step_off"]
    for value in dict.fromkeys(args.inflight):
        k, _, c = value.partition("x")
        tag = "" if value == "1" else f"_k{k}" + (f"c{c}" if c else "")
        arms += [f"fully_async_{bound}{tag}" for bound in (1, 2, 4)]
        if args.pause_mode != "none":
            arms += [f"fully_async_{bound}{tag}_pause" for bound in (1, 2)]
    results: dict[str, dict[str, float]] = {}
    with (
        tempfile.TemporaryDirectory(dir="/tmp") as tmp,
        server_url(Path(tmp), arch, args) as url,
        SGLangClient([url], timeout_s=600.0, max_retries=0) as client,
    ):
        warm_up = SamplingParams(max_new_tokens=4)
        client.generate([GenerationRequest(prompt_ids=[5, 6], n=1, group_id=0, sampling=warm_up)])
        if args.train_tokens_per_s is None:
            args.train_tokens_per_s = calibrate(client, draws, args) / args.train_ratio
        for round_ in range(args.rounds):  # forwards, then backwards: load drift reaches every arm
            for name in arms if round_ % 2 == 0 else arms[::-1]:
                result = run_arm(name, client, draws, args)
                for key, value in result.items():
                    results.setdefault(name, {}).setdefault(key, 0.0)
                    results[name][key] += value / args.rounds
    print(
        f"tiny Qwen3-MoE (hidden {args.hidden}, {args.layers} layers) on {ENGINES[args.engine]}; {args.prompts} "
        f"samples per "
        f"step, steps 2-{args.steps}; lengths lognormal median {args.median:g} sigma {args.sigma:g} cap {args.cap}: "
        f"median {ranked[len(ranked) // 2]}, max {ranked[-1]}, {tail:.1%} >= 8x median; simulated trainer "
        f"{args.train_tokens_per_s:.1f} tokens/s, sync {args.sync_s:g} s; fully_async chunk {args.chunk}, "
        f"{' / '.join(args.inflight)} in flight; {'static' if args.static_batches else 'continuous'} batching; load "
        f"average {os.getloadavg()[0]:.1f}"
    )
    sync, off = results["sync"]["samples_per_s"], results["one_step_off"]["samples_per_s"]
    header = f"{'arm':22s} {'tokens':>7s} {'tokens/s':>9s} {'samples/s':>10s} {'trainer idle':>13s} {'generating':>11s}"
    header += f" {'staleness':>10s}"
    print(f"{header} {'vs sync':>8s} {'vs 1-off':>9s}")
    for name in arms:
        r = results[name]
        print(
            f"{name:22s} {r['tokens']:7.0f} {r['tokens'] / r['wall_s']:9.1f} {r['samples_per_s']:10.2f} {r['trainer_idle']:13.1%} {r['generating']:11.1%} "
            f"{r['staleness']:10.2f} {r['samples_per_s'] / sync:7.2f}x {r['samples_per_s'] / off:8.2f}x"
        )


if __name__ == "__main__":
    main()
