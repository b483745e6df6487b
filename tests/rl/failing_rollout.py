"""Run ``sapo-megatron`` with the rollout of one RL step failing on the main rank, as a lost rollout engine would:
``SAPO_TEST_ROLLOUT_FAIL_AT=<0-based RL step>``. Under ``trainer.rollout_mode: one_step_off`` that rollout runs in the
background thread, during the step before."""

from __future__ import annotations

import os
import sys

from sapo_megatron.cli import main
from sapo_megatron.loop import trainer
from sapo_megatron.rollout.base import RolloutError


def install() -> None:
    fail_at = int(os.environ["SAPO_TEST_ROLLOUT_FAIL_AT"])
    rollout = trainer._rollout

    def failing_rollout(session, prompts, step, groups):
        if step == fail_at:
            error = RolloutError(f"injected: the rollout engine went away generating step {step}")
            error.hint = "restart it"
            raise error
        return rollout(session, prompts, step, groups)

    trainer._rollout = failing_rollout


if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))
