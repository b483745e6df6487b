"""Generated tokens/s of concurrent multi-turn episodes against single-turn generations on the same engine.

    python bench/bench_multiturn.py [--episodes 64] [--turns 3] [--tokens-per-turn 16] [--tool-latency-s 0.2 ...]
                                    [--observation-tokens 8] [--engine http|cpu|both|sglang] [--hidden 128]
                                    [--rounds 2] [--stream-window 2] [--stream-in-flight 64 128]
                                    [--sglang-flags '--enable-mixed-chunk --chunked-prefill-size 4096']

Multi-turn arm: ``--episodes`` episodes at once through :class:`~sapo_megatron.rollout.episodes.EpisodeEngine`,
each ``--turns`` engine turns of ``--tokens-per-turn`` tokens with a tool call between turns (an async tool that
sleeps ``--tool-latency-s``; one run per value given, through the ToolSet's timeout and concurrency cap) whose observation appends
``--observation-tokens`` ids. Single-turn arm: the same number of samples, each one response of
``turns × tokens-per-turn`` tokens, in one ``generate`` call. Both count the tokens the engine sampled (observations
excluded) over the wall time of the call; the ratio multi / single is the headline (goal ≥ 0.8). Each round also
times ``--episodes`` one-token requests, which with the single-turn round gives the engine's cost model
``T(n) = c + n·d`` and the ratio's bound with instant tools (:func:`request_cost`).

Engines: ``http`` is the CPU server (SGLang's API and, as an SGLang worker, continuous batching: a turn's request
joins the running batch between decode steps; ``--static-batches``: static batches gathered over
``--batch-window-s``) behind :class:`~sapo_megatron.rollout.sglang.client.SGLangClient`, the path SGLang servers take;
``cpu`` is the in-process CPU engine, where the ready turns of all episodes go in one forward. The model is a
random tiny Qwen3-MoE widened to ``--hidden`` whose end-of-sequence token is out of its reach, so every response
runs to its limit. ``sglang`` is a real SGLang server on CPU (``tools/sglang_cpu/serve.sh`` from
``$SAPO_SGLANG_VENV``, default /opt/sapo-sglang-venv, as tests/sglang_real starts it: float32, one thread) with
continuous batching and its prefix cache, on the embedded demo's architecture and character tokenizer with the
end-of-sequence token removed from model and tokenizer (so responses run to their limit there too); the server's
start (1-3 minutes) is not timed. The arms alternate for ``--rounds`` rounds; medians are printed.

Streaming arm (``stream_<m>``, server engines only: ``http`` and ``sglang``): episodes that do not move in
lockstep. A pool keeps m episodes in flight (``--stream-in-flight``, default ``--episodes``), each slot a thread
that runs one episode (its own ``generate`` call of one sample through the same ``EpisodeEngine``, one engine call
per turn) and starts the next the moment it ends; the client still sends at most ``--episodes`` requests at once
(its ``max_concurrency``, as in the other arms), so m > episodes keeps more episodes alive – some in their tools –
without a larger running batch than the single-turn arm's. Slot i starts i/m of D after the first, D the wall
time of the same round's lockstep arm (one episode's duration with everything in flight), so the tool waits of
the slots are spread over an episode from the start. The engine is wrapped to record when each turn's call
returns and how many tokens it sampled; the rate is the tokens of the turns that returned inside a window [D, D + ``--stream-window`` × D] after the first start,
divided by the window's length: warm-up (the staggered ramp) and the drain (no new episode starts after the
window) are outside it. The ratio stream / single compares it with the single-turn arm's batch of the same number
of samples (``turns × tokens-per-turn`` each) in one call, as the lockstep ratio does.

What the stream arm stands for: generation that never waits for the slowest episode of a batch, i.e. a producer
that starts new episodes while others still run their tools. The fully-async pipeline (``loop/fully_async.py``)
keeps generating while the trainer trains and, with ``trainer.async_inflight_chunks: K``, overlaps K chunks (one
``collect`` call each); the episodes of one chunk still start together, so the stream arm is the limit of many
small overlapping chunks (per-episode admission), measured on the same engine, not a run of the pipeline.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.real_sglang import save_sglang_model, sglang_server  # noqa: E402


def save_model(path: Path, hidden: int) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        eos_token_id=None,  # no stop token: every response runs to max_new_tokens
    )
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def episode_fn(turns: int, tokens_per_turn: int, observation: list[int]):
    from sapo_megatron.rollout.episodes import ToolCall
    from sapo_megatron.rollout.types import EpisodeInfo

    async def run(ctx, ledger) -> EpisodeInfo:
        calls = 0
        for turn in range(turns):
            ledger.add_turn(await ctx.generate(list(ledger.tokens), tokens_per_turn))
            if turn + 1 < turns:
                await ctx.tools.call(ToolCall("wait"))
                calls += 1
                ledger.add_observation(observation)
        return EpisodeInfo(status="completed", turns=ledger.turns, tool_calls=calls)

    return run


def build_episodes(engine, args, parallel_calls: int):
    from sapo_megatron.rollout.episodes import EpisodeEngine, EpisodeLimits, Tool, ToolSet

    async def wait(**_: object) -> str:
        await asyncio.sleep(args.tool_latency_s)
        return "ok"

    tools = ToolSet(
        [Tool({"type": "function", "function": {"name": "wait"}}, wait)],
        timeout_s=60,
        max_concurrent=args.episodes,
        max_output_chars=100,
    )
    limits = EpisodeLimits(
        max_turns=args.turns,
        max_tool_calls=args.turns,
        max_context_tokens=1024,
        max_new_tokens=args.tokens_per_turn,
    )
    observation = list(range(40, 40 + args.observation_tokens))
    return EpisodeEngine(
        engine,
        episode_fn(args.turns, args.tokens_per_turn, observation),
        tools=tools,
        deltas=None,
        limits=limits,
        decode=str,
        parallel_calls=parallel_calls,
        user_function=True,
    )


def requests(args, max_new_tokens: int, seed: int):
    from sapo_megatron.rollout.types import GenerationRequest, SamplingParams

    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
    groups = args.episodes // 4
    return [
        GenerationRequest(
            prompt_ids=[3 + g % 50, 5, 7, 11, 13, 17][: 3 + g % 4], n=4, sampling=sampling, group_id=g
        )
        for g in range(groups)
    ]


def timed(engine, reqs) -> tuple[float, int]:
    started = time.perf_counter()
    groups = engine.generate(reqs)
    elapsed = time.perf_counter() - started
    return elapsed, sum(s.generated_tokens for g in groups for s in g)


class TurnClock:
    """The engine, recording when each call returns and the tokens it sampled (everything else passes through)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.turns: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def generate(self, reqs):
        groups = self.engine.generate(reqs)
        tokens = sum(s.generated_tokens for g in groups for s in g)
        with self._lock:
            self.turns.append((time.perf_counter(), tokens))
        return groups

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def streamed(
    engine, args, parallel_calls: int, episode_s: float, seed: int, in_flight: int
) -> tuple[float, int]:
    """Tokens/s of a pool of ``in_flight`` episodes (see the module's docstring) and the tokens counted in its
    window."""
    clock = TurnClock(engine)
    episodes = build_episodes(clock, args, max(parallel_calls, in_flight))
    start = time.perf_counter()
    window = (start + episode_s, start + episode_s * (1 + args.stream_window))
    errors: list[BaseException] = []

    def slot(i: int) -> None:
        time.sleep(i * episode_s / in_flight)
        k = 0
        while time.perf_counter() < window[1] and not errors:
            prompt = requests(args, args.tokens_per_turn, seed)[i % args.episodes // 4]  # the lockstep arm's
            req = dataclasses.replace(prompt, n=1, group_id=i * 10_000 + k)
            try:
                episodes.generate([req])
            except BaseException as error:  # re-raised below
                errors.append(error)
            k += 1

    threads = [threading.Thread(target=slot, args=(i,), daemon=True) for i in range(in_flight)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    tokens = sum(n for at, n in clock.turns if window[0] <= at <= window[1])
    return tokens / (window[1] - window[0]), tokens


def bench_engine(name: str, engine, args, parallel_calls: int) -> list[dict]:
    """One result per tool latency of ``args.tool_latency_s``."""
    return [
        {
            "tool_latency_s": latency,
            **bench_latency(
                name, engine, argparse.Namespace(**{**vars(args), "tool_latency_s": latency}), parallel_calls
            ),
        }
        for latency in args.tool_latency_s
    ]


def bench_latency(name: str, engine, args, parallel_calls: int) -> dict:
    episodes = build_episodes(engine, args, parallel_calls)
    total = args.turns * args.tokens_per_turn
    timed(engine, requests(args, 4, seed=0))  # warm-up
    single, multi, one_token, full = [], [], [], []
    stream: dict[int, list[float]] = {m: [] for m in args.stream_in_flight}
    for round_ in range(args.rounds):
        one_token.append(timed(engine, requests(args, 1, seed=round_))[0])
        seconds, tokens = timed(engine, requests(args, total, seed=round_))
        single.append(tokens / seconds)
        full.append(seconds)
        seconds, tokens = timed(episodes, requests(args, args.tokens_per_turn, seed=round_))
        multi.append(tokens / seconds)
        assert tokens == args.episodes * total, tokens
        if parallel_calls > 1:  # a pool of one-sample calls needs an engine that takes calls in parallel
            for m in args.stream_in_flight:
                rate, tokens = streamed(engine, args, parallel_calls, seconds, round_, in_flight=m)
                assert tokens > 0, "no turn returned inside the stream window"
                stream[m].append(rate)
    result = {
        "engine": name,
        "single_turn_tokens_per_s": round(statistics.median(single), 1),
        "multi_turn_tokens_per_s": round(statistics.median(multi), 1),
        "engine_calls_per_round": episodes.metrics()["episode/engine_calls"] / args.rounds,
    }
    result["ratio"] = round(result["multi_turn_tokens_per_s"] / result["single_turn_tokens_per_s"], 3)
    result |= request_cost(statistics.median(one_token), statistics.median(full), args.turns, total)
    result["per_round"] = {
        "single": [round(x, 1) for x in single],
        "lockstep": [round(x, 1) for x in multi],
    }
    # the median of each round's own ratio too: the arms of a round run back to back, so a change of the machine's
    # load between rounds moves both sides of that round's ratio
    result["ratio_of_rounds"] = round(statistics.median(m / s for m, s in zip(multi, single)), 3)
    for m, rates in stream.items():
        if rates:
            rate = round(statistics.median(rates), 1)
            result[f"stream_{m}_tokens_per_s"] = rate
            result[f"stream_{m}_ratio"] = round(rate / result["single_turn_tokens_per_s"], 3)
            result[f"stream_{m}_ratio_of_rounds"] = round(
                statistics.median(r / s for r, s in zip(rates, single)), 3
            )
            result["per_round"][f"stream_{m}"] = [round(x, 1) for x in rates]
    return result


def request_cost(one_token_s: float, full_s: float, turns: int, total: int) -> dict[str, float]:
    """The engine's cost model from two timed rounds of ``--episodes`` requests, ``T(n) = c + n·d``: one token
    each (``one_token_s``) and the single-turn arm's ``total`` tokens each (``full_s``). ``d`` is a decode step of
    the whole batch, ``c`` what a round of requests costs besides its decode steps (sending, prefill, scheduling,
    replies). ``ratio_bound_no_tool_wait``: the multi / single ratio if every tool answered at once and the turns
    overlapped perfectly, ``T(total) / (turns·c + total·d)`` – each turn is a request and pays ``c`` again."""
    step = max(full_s - one_token_s, 0.0) / max(total - 1, 1)
    fixed = max(one_token_s - step, 0.0)
    return {
        "round_of_requests_s": round(fixed, 4),
        "decode_step_s": round(step, 5),
        "ratio_bound_no_tool_wait": round(full_s / (turns * fixed + total * step), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens-per-turn", type=int, default=16)
    parser.add_argument(
        "--tool-latency-s", type=float, nargs="+", default=[0.2], help="one run per value (one engine start)"
    )
    parser.add_argument("--observation-tokens", type=int, default=8)
    parser.add_argument("--engine", choices=("http", "cpu", "both", "sglang"), default="both")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--stream-window",
        type=float,
        default=2.0,
        help="the stream arm's measuring window, in lockstep-episode durations after one of warm-up",
    )
    parser.add_argument(
        "--stream-in-flight",
        type=int,
        nargs="+",
        default=None,
        help="episodes the stream arm keeps in flight, one arm per value (default: --episodes); the client "
        "still sends at most --episodes requests at once, as in the other arms",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument(
        "--batch-window-s",
        type=float,
        default=0.05,
        help="with --static-batches, the CPU server's batching window: requests arriving within it share a batch "
        "(a request that misses one waits for the whole batch to finish)",
    )
    parser.add_argument(
        "--static-batches",
        action="store_true",
        help="the CPU server runs static batches (default: continuous)",
    )
    parser.add_argument(
        "--sglang-flags",
        default="",
        help="with --engine sglang, more sglang.launch_server flags in one string, e.g. "
        "'--enable-mixed-chunk --chunked-prefill-size 4096' (prefill batches ride along with a decode step)",
    )
    args = parser.parse_args(argv)
    if args.episodes % 4:
        parser.error("--episodes must be a multiple of 4 (groups of 4 samples)")
    args.stream_in_flight = args.stream_in_flight or [args.episodes]

    from sapo_megatron.rollout.cpu.engine import CPUEngine
    from sapo_megatron.rollout.cpu.server import CPUServer
    from sapo_megatron.rollout.sglang.client import SGLangClient

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.engine == "sglang":
            model = save_sglang_model(Path(tmp) / "model", args.hidden)
            flags = shlex.split(args.sglang_flags)
            with sglang_server(model, Path(tmp) / "sglang.log", extra_flags=flags) as url:
                client = SGLangClient([url], max_concurrency=args.episodes, timeout_s=300.0, max_retries=0)
                results.extend(bench_engine("sglang (real, CPU)", client, args, args.episodes))
                client.close()
            print(json.dumps({"settings": settings(args), "results": results}, indent=1))
            return 0
        model = save_model(Path(tmp) / "model", args.hidden)
        engine = CPUEngine.from_pretrained(model, seed=0, num_threads=args.threads)
        if args.engine in ("cpu", "both"):
            results.extend(bench_engine("cpu (in-process)", engine, args, parallel_calls=1))
        if args.engine in ("http", "both"):
            server = CPUServer(engine, batch_window_s=args.batch_window_s, static_batches=args.static_batches)
            with server.start():
                client = SGLangClient([server.url], max_concurrency=args.episodes)
                results.extend(bench_engine("http (CPU server, SGLang API)", client, args, args.episodes))
                client.close()
    print(json.dumps({"settings": settings(args), "results": results}, indent=1))
    return 0


def settings(args: argparse.Namespace) -> dict:
    names = (
        "episodes",
        "turns",
        "tokens_per_turn",
        "tool_latency_s",
        "observation_tokens",
        "hidden",
        "batch_window_s",
        "static_batches",
        "stream_window",
        "stream_in_flight",
        "sglang_flags",
    )
    return {k: getattr(args, k) for k in names}


if __name__ == "__main__":
    raise SystemExit(main())
