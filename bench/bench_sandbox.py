"""The code sandbox's cost per run (``rewards/sandbox.py``) against starting the same interpreter bare, measured
in the same run: ``--runs`` trivial programs each way, alternating, and one ``code_exec`` assertion test (the
checker process beside the solution's) per round.

    python bench/bench_sandbox.py [--runs 50]

Prints the median wall time of a bare ``python -I -c pass``, of ``run_python`` on ``pass`` (namespaces, private
root, limits), of one ``code_exec`` assertion test, the ratios to the bare start, what :func:`isolation` reports,
and the load average (the development machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

from sapo_megatron.rewards.code_exec import code_exec
from sapo_megatron.rewards.sandbox import SandboxLimits, isolation, run_python, sandbox_python


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    python = sandbox_python()
    found = isolation()
    limits = SandboxLimits(wall_s=30.0)
    tests = {"test": "assert add(1, 2) == 3"}
    solution = "```python\ndef add(a, b):\n    return a + b\n```"
    bare, boxed, checked = [], [], []
    for _ in range(args.runs):
        bare.append(_timed(lambda: subprocess.run([python, "-I", "-c", "pass"], check=True)))
        boxed.append(_timed(lambda: run_python({"s.py": "pass"}, "s.py", limits=limits)))
        checked.append(_timed(lambda: code_exec(solution, "", tests, wall_s=30.0, total_wall_s=60.0)))
    medians = {name: statistics.median(times) for name, times in (("bare", bare), ("sandbox", boxed))}
    medians["code_exec_assert"] = statistics.median(checked)
    report = {
        "runs": args.runs,
        "median_s": {name: round(value, 4) for name, value in medians.items()},
        "ratio_to_bare": {name: round(value / medians["bare"], 2) for name, value in medians.items()},
        "isolation": found,
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
