"""The first SIGTERM during a run's start-up ends it at once (issue 30, Hangs): a trainer waiting for a dead
router had nothing to checkpoint, yet waited for a second signal. Once the steps begin, the first signal asks
for a checkpoint as before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, time
from sapo_megatron.runtime.interrupts import InterruptGuard
with InterruptGuard(exit_until_started=True) as guard:
    if sys.argv[1] == "started":
        guard.started()
    print("waiting", flush=True)
    for _ in range(300):  # a start-up that never ends (a dead router)
        time.sleep(0.1)
        if guard.requested:
            print("stopping after the step", flush=True)
            break
"""


def run_and_signal(mode: str) -> tuple[int, str, float]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.readline().strip() == "waiting"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out, time.monotonic() - sent


def test_the_first_sigterm_in_start_up_exits_at_once():
    code, out, seconds = run_and_signal("starting")
    assert code == 130 and seconds < 3
    assert "SIGTERM during start-up: nothing to save yet, exiting now" in out


def test_after_start_up_the_first_sigterm_asks_for_a_checkpoint():
    code, out, _ = run_and_signal("started")
    assert code == 0 and "stopping after the step" in out and "during start-up" not in out
