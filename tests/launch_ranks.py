"""``python -m tests.launch_ranks [--settle-s S] NPROCS COMMAND...``: :func:`launch_local` as a process, for
``tests/test_interrupts.py``."""

from __future__ import annotations

import argparse
import sys

from sapo_megatron.runtime.local_launch import launch_local

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("nprocs", type=int)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    sys.exit(launch_local(args.command, args.nprocs, settle_s=args.settle_s, grace_s=5.0))
