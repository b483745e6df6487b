"""Reward throughput: the worker pool against inline calls, measured in the same run.

    python bench/bench_rewards.py [--workers N] [--math 300] [--code 24] [--demo 4096] [--repeats 3]

Three rewards, each scored inline (``reward_workers: 0``: in this process, one call after the other) and in the
pool (``reward_workers: N``, default the CPU count), on the same inputs, alternating (inline, pool, inline, ...)
for ``--repeats`` rounds; the medians are printed with the speed-up ``inline_s / pool_s``:

- ``math_verify`` on ``--math`` responses (boxed fractions, plain numbers, LaTeX expressions, wrong answers);
- ``code_exec`` on ``--code`` programs, each run against 3 stdin/stdout tests in the sandbox;
- ``numeric_match`` on ``--demo`` synthetic-addition responses: the demo's reward, which ``reward_workers: auto``
  keeps inline; also timed through the old per-sample path (``SafeReward``) to show the runner adds nothing.

The pool's start (the workers importing the reward) is timed apart and excluded: it is paid once per run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from sapo_megatron.rewards.registry import SafeReward, get_reward
from sapo_megatron.rewards.runner import build_reward_runner
from sapo_megatron.rewards.types import RewardInput


def math_inputs(n: int, rng: random.Random) -> list[RewardInput]:
    out = []
    for i in range(n):
        a, b = rng.randint(1, 50), rng.randint(2, 60)
        kind = i % 4
        if kind == 0:
            response, label = (
                f"We simplify. The answer is $\\boxed{{\\frac{{{a}}}{{{b}}}}}$.",
                f"{a / b:.12g}",
            )
        elif kind == 1:
            response, label = f"Adding gives {a} + {b} = {a + b}", str(a + b + (i % 8 == 1))
        elif kind == 2:
            response, label = f"So $x = \\sqrt{{{a * a}}} + {b}$, i.e. \\boxed{{{a + b}}}", str(a + b)
        else:
            response, label = f"Expanding, $(x+{a})^2 = x^2+{2 * a}x+{a * a}$", f"(x+{a})^2"
        out.append(RewardInput(response=response, label=label))
    return out


def code_inputs(n: int) -> list[RewardInput]:
    tests = json.dumps({"inputs": ["3\n", "10\n", "0\n"], "outputs": ["9\n", "100\n", "0\n"]})
    programs = ["n = int(input())\nprint(n * n)", "n = int(input())\nprint(n + n)"]
    return [RewardInput(response=f"```python\n{programs[i % 2]}\n```", label=tests) for i in range(n)]


def demo_inputs(n: int, rng: random.Random) -> list[RewardInput]:
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append(RewardInput(response=f"{a}+{b}={a + b + rng.choice([0, 0, 1])}", label=f"{a}+{b}={a + b}"))
    return out


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def compare(name: str, items: list[RewardInput], workers: int, repeats: int, kwargs=None) -> None:
    start_s, pool = timed(lambda: build_reward_runner(name, workers=workers, timeout_s=60, kwargs=kwargs))
    inline = build_reward_runner(name, workers=0, kwargs=kwargs)
    warm_s, _ = timed(lambda: pool.score(items[: workers * 2]))  # every worker has imported the reward
    inline_s, pool_s = [], []
    for _ in range(repeats):
        seconds, expected = timed(lambda: inline.score(items))
        inline_s.append(seconds)
        seconds, got = timed(lambda: pool.score(items))
        pool_s.append(seconds)
        assert [o.score for o in got] == [o.score for o in expected], "pool and inline disagree"
        assert not any(o.error for o in got), [o.error for o in got if o.error][:3]
    pool.close()
    a, b = statistics.median(inline_s), statistics.median(pool_s)
    print(
        f"{name:13s} {len(items):5d} samples  inline {a:7.3f} s ({len(items) / a:8.1f}/s)  "
        f"pool[{workers}] {b:7.3f} s ({len(items) / b:8.1f}/s)  speed-up inline/pool {a / b:5.2f}x  "
        f"(pool start {start_s + warm_s:.2f} s, once)"
    )


def demo(items: list[RewardInput], repeats: int) -> None:
    runner = build_reward_runner("numeric_match", workers="auto")
    old = SafeReward(get_reward("numeric_match"), "numeric_match")
    new_s, old_s = [], []
    for _ in range(repeats):
        new_s.append(timed(lambda: runner.score(items))[0])
        old_s.append(timed(lambda: [old(i.response, i.label) for i in items])[0])
    a, b = statistics.median(new_s), statistics.median(old_s)
    print(
        f"numeric_match {len(items):5d} samples  runner (auto = inline) {a * 1e3:7.2f} ms  "
        f"old SafeReward path {b * 1e3:7.2f} ms  ratio {a / b:5.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--math", type=int, default=300)
    parser.add_argument("--code", type=int, default=24)
    parser.add_argument("--demo", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    compare("math_verify", math_inputs(args.math, rng), args.workers, args.repeats)
    compare("code_exec", code_inputs(args.code), args.workers, args.repeats, kwargs={"mode": "fraction"})
    demo(demo_inputs(args.demo, rng), args.repeats)
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
