"""A tiny training loop under :class:`InterruptGuard`, run as a subprocess by ``tests/test_interrupts.py``.

``python tests/signal_loop.py [--steps N] [--step-s S] [--signals ...] [--stall-after K] [--fail-after K] [--child]``; with
``WORLD_SIZE`` > 1 in the environment it joins a gloo process group and stops on the combined flag. Prints
``rank R step K`` after each step and ``rank R stopped at K (REASON)`` when it stops (exit code 130).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from sapo_megatron.runtime.interrupts import InterruptGuard, print_line
from sapo_megatron.runtime.local_launch import note_failure


def say(line: str) -> None:
    """One write(2) per line: ranks share the launcher's stdout pipe, and a short write to a pipe is atomic. Not
    through sys.stdout: a signal arriving while its buffer is flushed runs the guard's announcement (to the same
    pipe, via stderr) in between, and the step line could reach the test cut in two."""
    os.write(1, (line + "\n").encode())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--signals", default="SIGINT,SIGTERM,SIGUSR1")
    parser.add_argument("--stall-after", type=int, help="after this step, rank --stall-rank sleeps 120 s")
    parser.add_argument("--stall-rank", type=int, default=0)
    parser.add_argument("--fail-after", type=int, help="after this step, rank --fail-rank exits with code 7")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--child", action="store_true", help="start a child process that would outlive us")
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    if args.child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        say(f"child {child.pid}")
    with InterruptGuard(args.signals.split(","), announce=print_line if rank == 0 else None) as guard:
        for step in range(1, args.steps + 1):
            time.sleep(args.step_s)
            say(f"rank {rank} step {step}")
            if step == args.fail_after and rank == args.fail_rank:
                note_failure()  # as sapo-megatron's command line does on a non-zero status
                return 7
            if step == args.stall_after and rank == args.stall_rank:
                time.sleep(120)  # a long call; the other ranks wait for this one in should_stop's all-reduce
            if guard.should_stop():
                say(f"rank {rank} stopped at {step} ({guard.reason})")
                return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
