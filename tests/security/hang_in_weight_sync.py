"""Run ``sapo-megatron`` whose weight push after RL step ``SAPO_TEST_HANG_AT`` waits on a peer that never answers
(as a dead SGLang server would hold it, up to rollout.weight_sync_timeout_s), and SIGTERM it during that wait."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from concurrent.futures import Future

from sapo_megatron.cli import main
from sapo_megatron.runtime.interrupts import wait_for
from sapo_megatron.weight_sync import modes


def install() -> None:
    hang_at = int(os.environ["SAPO_TEST_HANG_AT"])
    push = modes.WeightSync.push

    def hanging_push(self, module):
        if self.version == hang_at:  # version 0 is the push before RL; version k follows step k
            hung = time.monotonic()
            atexit.register(
                lambda: print(f"exited {time.monotonic() - hung:.1f} s after the hang", flush=True)
            )
            os.kill(os.getpid(), signal.SIGTERM)
            print("weight sync: waiting for a server that never answers", flush=True)
            wait_for([Future()], "update_weights_from_disk")  # what every weight-sync wait of the client does
        return push(self, module)

    modes.WeightSync.push = hanging_push


if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))
