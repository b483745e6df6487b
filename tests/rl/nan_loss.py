"""Run ``sapo-megatron`` with the SFT loss poisoned (NaN) from a given step on: ``SAPO_TEST_NAN_FROM=<sft step>``."""

from __future__ import annotations

import os
import sys

from sapo_megatron.cli import main
from sapo_megatron.loop import trainer


def install() -> None:
    first_bad = int(os.environ["SAPO_TEST_NAN_FROM"])
    sft_loss, calls = trainer.sft_loss, {"n": 0}

    def poisoned(logits, batch):
        loss, metrics = sft_loss(logits, batch)
        calls["n"] += 1  # one micro-batch per step in the tests that use this
        return (loss * float("nan") if calls["n"] >= first_bad else loss), metrics

    trainer.sft_loss = poisoned


if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))
