"""How fast the command line answers, against the time Python takes to import torch, measured in one run.

    python bench/bench_cli_startup.py [--rounds 5]

Three commands, each a fresh interpreter, interleaved round by round so that a change in the machine's load
reaches all of them; the medians are compared:

- ``python -c "import torch"``: the yardstick;
- ``sapo-megatron --help``: goal ≤ 1.0× (it imports neither torch nor pydantic);
- ``sapo-megatron train --output-dir DIR`` where DIR already holds a run (one logged step): refused with the
  one-line error, goal ≤ 1.5× (the config, its layout, the input files and the output-directory policy are
  checked before torch's heavy users – Megatron, transformers – are imported).

Prints the medians and the two ratios, and exits 1 when a ratio misses its goal. The load average is printed
with the result: on a busy 2-core machine the spread between rounds is large, the ratios much less so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOALS = {"help": 1.0, "refused re-run": 1.5}


def timed(command: list[str], *, expect_rc: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    elapsed = time.perf_counter() - start
    if proc.returncode != expect_rc:
        raise SystemExit(f"{' '.join(command)}: exit {proc.returncode}, expected {expect_rc}\n{proc.stderr}")
    return elapsed


def held_run(root: Path) -> Path:
    """A directory that holds a run: one logged RL step (what ``run_dir`` counts as progress)."""
    run_dir = root / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"phase": "rl", "step": 1}\n')
    return run_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs of each command (default: 5)")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "sapo_megatron.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        commands = {
            "import torch": ([sys.executable, "-c", "import torch"], 0),
            "help": ([*cli, "--help"], 0),
            "refused re-run": ([*cli, "train", "--output-dir", str(held_run(Path(tmp)))], 1),
        }
        timed(commands["import torch"][0], expect_rc=0)  # warm the file cache once
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.rounds):
            for name, (command, rc) in commands.items():
                times[name].append(timed(command, expect_rc=rc))
    medians = {name: statistics.median(values) for name, values in times.items()}
    torch_s = medians["import torch"]
    print(f"load average {os.getloadavg()[0]:.2f}, {args.rounds} rounds, medians:")
    for name, value in medians.items():
        print(f"  {name:<16} {value:6.2f} s")
    missed = []
    for name, goal in GOALS.items():
        ratio = medians[name] / torch_s
        verdict = "ok" if ratio <= goal else "MISSED"
        print(f"{name} / import torch = {ratio:.2f} (goal <= {goal}) {verdict}")
        if ratio > goal:
            missed.append(name)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
