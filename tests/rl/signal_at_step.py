"""Run ``sapo-megatron`` and send it a signal right after a given step, as a user's Ctrl-C or SLURM's pre-timeout
signal would arrive: ``SAPO_TEST_SIGNAL_AT=<phase>:<step>[:<signal name>]`` (default SIGINT)."""

from __future__ import annotations

import os
import signal
import sys
import time

from sapo_megatron.cli import main
from sapo_megatron.loop import trainer


def install() -> None:
    phase, step, *name = os.environ["SAPO_TEST_SIGNAL_AT"].split(":")
    signum = getattr(signal, name[0] if name else "SIGINT")
    end_of_step = trainer.end_of_step

    def signalled_end_of_step(session, state, at_phase, metrics):
        current = state.sft_step if at_phase == "sft" else state.step
        if at_phase == phase and current == int(step):
            os.kill(os.getpid(), signum)
            # the guard's watcher thread takes the signal (late on a busy machine); this step's stop decision
            # must see it
            deadline = time.monotonic() + 60
            while not session.guard.requested and time.monotonic() < deadline:
                time.sleep(0.05)
        return end_of_step(session, state, at_phase, metrics)

    trainer.end_of_step = signalled_end_of_step


if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))
