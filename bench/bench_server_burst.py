"""The CPU server's ``/generate`` throughput under a burst of concurrent requests, before and after the request
limits of issue 20 (auth before body, body / connection caps, per-field checks, client-gone checks), measured in
one run: the same tiny Qwen3-MoE served by two server processes, one from a baseline checkout (``--baseline``, e.g.
``/work/main``) and one from this checkout, bursts alternating between them.

    python bench/bench_server_burst.py [--baseline /work/main] [--requests 200] [--rounds 6] [--new-tokens 8]

Each burst sends ``--requests`` requests at once (one connection each, like the rollout client at concurrency
``--requests``), each one prompt of 8 tokens and ``--new-tokens`` sampled tokens. Prints requests/s per server
(median of the rounds), the failures (must be 0) and the ratio this / baseline (1.0: the limits cost nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def start_server(code_dir: Path, model_dir: Path):
    from sapo_megatron.rollout.cpu.process import ServerProcess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code_dir)}
    return ServerProcess("--model-path", str(model_dir), "--port", "0", "--threads", "1", env=env)


def burst(url: str, requests: int, new_tokens: int) -> tuple[float, int]:
    """Seconds for ``requests`` simultaneous /generate calls, and how many failed."""
    limits = httpx.Limits(max_connections=requests, max_keepalive_connections=requests)
    failures = 0
    with httpx.Client(base_url=url, timeout=300, limits=limits) as http:
        gate = threading.Barrier(requests + 1)

        def one(i: int) -> None:
            nonlocal failures
            body = {
                "input_ids": [1 + (i + t) % 60 for t in range(8)],
                "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "sampling_seed": i},
            }
            gate.wait()
            try:
                ok = http.post("/generate", json=body).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                failures += 1

        threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
        for thread in threads:
            thread.start()
        gate.wait()
        started = time.perf_counter()
        for thread in threads:
            thread.join()
        return time.perf_counter() - started, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline", type=Path, default=Path("/work/main"), help="checkout before the limits"
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    from sapo_megatron.model.tiny import make_tiny_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_hf_checkpoint(Path(tmp) / "tiny_moe")
        servers = {"baseline": start_server(args.baseline, model_dir), "this": start_server(REPO, model_dir)}
        try:
            for server in servers.values():
                burst(server.url, 16, args.new_tokens)  # warm-up
            seconds: dict[str, list[float]] = {name: [] for name in servers}
            failed = dict.fromkeys(servers, 0)
            for round_ in range(args.rounds):
                order = list(servers.items())
                for name, server in order if round_ % 2 == 0 else order[::-1]:  # no order advantage
                    took, failures = burst(server.url, args.requests, args.new_tokens)
                    seconds[name].append(took)
                    failed[name] += failures
        finally:
            for server in servers.values():
                server.stop(timeout_s=60)
    rate = {name: args.requests / statistics.median(values) for name, values in seconds.items()}
    print(
        f"burst of {args.requests} concurrent /generate ({args.new_tokens} new tokens each), {args.rounds} rounds"
    )
    for name in servers:
        runs = ", ".join(f"{s:.2f}" for s in seconds[name])
        print(f"  {name:8s} {rate[name]:7.1f} requests/s (burst seconds: {runs}; failed: {failed[name]})")
    print(f"  ratio this / baseline: {rate['this'] / rate['baseline']:.3f}")


if __name__ == "__main__":
    main()
