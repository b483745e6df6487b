"""The reward worker process on its own: a trainer that goes away before the worker answers (a short dry run, a
stopped run) must not make the worker print a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

from sapo_megatron.rewards.framing import write_frame


def test_a_worker_whose_trainer_closed_the_pipe_exits_quietly():
    process = subprocess.Popen(
        [sys.executable, "-m", "sapo_megatron.rewards.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "SAPO_REWARD_TRAINER_PID": str(os.getpid())},
    )
    process.stdout.close()  # the trainer is gone before the worker says "ready"
    write_frame(process.stdin, ("init", "exact_match", {}))
    process.stdin.close()
    process.wait(timeout=60)
    stderr = process.stderr.read()
    assert process.returncode == 0, stderr.decode()
    assert b"Traceback" not in stderr and b"BrokenPipe" not in stderr, stderr.decode()
