#!/usr/bin/env python3
"""A stand-in for ``sapo-megatron`` (and for the python that runs it) to test the Slurm mechanics of
launch/slurm_train.sbatch without a model: what the ranks are started with, which signals reach them, requeue.

As ``SAPO_MEGATRON``: ``train CONFIG ... --launch-info`` prints ``nodes=N procs_per_node=P world_size=W`` from
STUB_NODES / STUB_PROCS; ``--dry-run`` prints a line. As ``SAPO_PYTHON`` (``-m sapo_megatron.cli train ...``): one
rank. It appends a JSON line ``{"event": "start", ...}`` to STUB_LOG, then waits up to STUB_RUN_S seconds; on
SIGUSR1 / SIGTERM it logs ``{"event": "signal", ...}``, "checkpoints" for STUB_CKPT_S seconds and exits 3 (as the
trainer does), otherwise it exits 0. Standard library only.
"""

import json
import os
import signal
import sys
import time


def log(event: str, **fields) -> None:
    record = {
        "event": event,
        "rank": os.environ.get("RANK"),
        "pid": os.getpid(),
        "time": time.time(),
        **fields,
    }
    with open(os.environ["STUB_LOG"], "a") as handle:
        handle.write(json.dumps(record) + "\n")


def rank_main(argv: list[str]) -> int:
    received: list[str] = []

    def on_signal(signum, _frame) -> None:
        received.append(signal.Signals(signum).name)
        log("signal", signal=signal.Signals(signum).name)

    for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    env_keys = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SAPO_WEIGHT_SYNC_ADDR",
        "GROUP_RANK",
        "SLURMD_NODENAME",
    )
    log(
        "start",
        argv=argv,
        env={key: os.environ.get(key) for key in env_keys},
        restart=os.environ.get("SLURM_RESTART_COUNT", "0"),
        api_key=os.environ.get("SAPO_ROLLOUT_API_KEY"),
    )
    deadline = time.time() + float(os.environ.get("STUB_RUN_S", "60"))
    while time.time() < deadline and not received:
        time.sleep(0.1)
    if received:
        time.sleep(float(os.environ.get("STUB_CKPT_S", "1")))
        log("checkpointed")
        return 3
    log("finished")
    return 0


def cli_main(argv: list[str]) -> int:
    if "--launch-info" in argv:
        nodes, procs = int(os.environ["STUB_NODES"]), int(os.environ["STUB_PROCS"])
        print(f"nodes={nodes} procs_per_node={procs} world_size={nodes * procs}")
        return 0
    if "--dry-run" in argv:
        log("dry-run", argv=argv)
        print("config OK (stub)")
        return 0
    print(f"stub_trainer: unexpected arguments {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:2] == ["-m", "sapo_megatron.cli"]:
        sys.exit(rank_main(args[2:]))
    sys.exit(cli_main(args))
