"""Optimizer steps that went wrong: counted, reported, and fatal when they keep happening.

The training engine skips an update whose loss or gradients are not finite on some rank (the weights and the LR
schedule stay as they were, see ``TrainEngine.train_step``). One such step is noise worth a metric; several in a row
mean the run is broken (a learning rate too high, corrupt data, an overflowing kernel) and it stops with an error
instead of producing a checkpoint of nonsense.
"""

from __future__ import annotations

import math

from sapo_megatron.errors import UserError


class NonFiniteTrainingError(UserError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


class BadStepGuard:
    """Counts consecutive skipped updates per run; raises after ``max_in_a_row`` of them."""

    def __init__(self, max_in_a_row: int) -> None:
        if max_in_a_row < 1:
            raise ValueError(f"max_in_a_row must be >= 1, got {max_in_a_row}")
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0

    def check(
        self, *, updated: bool, loss: float, grad_norm: float, phase: str, step: int
    ) -> dict[str, float]:
        """Record one optimizer step; returns its metrics. Raises :class:`NonFiniteTrainingError` when this is
        the ``max_in_a_row``-th skipped update in a row."""
        skipped = not updated or not math.isfinite(loss) or not math.isfinite(grad_norm)
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        self.total += int(skipped)
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteTrainingError(
                f"{self.in_a_row} optimizer steps in a row had a non-finite loss or gradient norm (last at "
                f"{phase} step {step}: loss={loss}, grad_norm={grad_norm}); their updates were skipped, so the "
                "weights are those of the last good step",
                hint="lower optimizer.lr (or sft.lr), check the data and rewards for NaN/inf, or raise "
                "trainer.max_bad_steps to tolerate more; resume from the last checkpoint with --resume",
            )
        return {"train/update_skipped": float(skipped), "train/skipped_updates_total": float(self.total)}

    def state_dict(self) -> dict[str, int]:
        return {"in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.in_a_row, self.total = int(state["in_a_row"]), int(state["total"])
