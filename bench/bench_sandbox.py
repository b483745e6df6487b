"""The code sandbox's cost per run (``rewards/sandbox.py``) against starting the same interpreter bare, measured
in the same run: ``--runs`` trivial programs each way, alternating, and one ``code_exec`` assertion test (the
checker process beside the solution's) per round.

    python bench/bench_sandbox.py [--runs 50]

Prints the median wall time of a bare ``python -I -c pass``, of ``run_python`` on ``pass`` (namespaces, private
root, limits), of one ``code_exec`` assertion test, the ratios to the bare start, the mean CPU time (user +
system) of the processes each one started, what :func:`isolation` reports, and the load average (the
development machine is shared: the CPU time is the steadier number there).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import time

from sapo_megatron.rewards.code_exec import code_exec
from sapo_megatron.rewards.sandbox import SandboxLimits, isolation, run_python, sandbox_python


def _timed(fn, cpu: list) -> float:
    """Wall seconds of ``fn()``; appends the CPU seconds its child processes used (user + system) to ``cpu``:
    on a shared machine that is steadier than the wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    python = sandbox_python()
    found = isolation()
    limits = SandboxLimits(wall_s=30.0)
    tests = {"test": "assert add(1, 2) == 3"}
    solution = "```python\ndef add(a, b):\n    return a + b\n```"
    runs = {
        "bare": lambda: subprocess.run([python, "-I", "-c", "pass"], check=True),
        "sandbox": lambda: run_python({"s.py": "pass"}, "s.py", limits=limits),
        "code_exec_assert": lambda: code_exec(solution, "", tests, wall_s=30.0, total_wall_s=60.0),
    }
    wall = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for _ in range(args.runs):
        for name, fn in runs.items():
            wall[name].append(_timed(fn, cpu[name]))
    medians = {name: statistics.median(times) for name, times in wall.items()}
    cpu_ms = {name: 1000 * sum(times) / len(times) for name, times in cpu.items()}
    report = {
        "runs": args.runs,
        "median_s": {name: round(value, 4) for name, value in medians.items()},
        "ratio_to_bare": {name: round(value / medians["bare"], 2) for name, value in medians.items()},
        "cpu_ms_per_run": {name: round(value, 1) for name, value in cpu_ms.items()},
        "isolation": found,
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
