"""What the training loop saves and restores: its position (:class:`LoopState`) next to the engine's model,
optimizer, LR schedule and RNG states, in ``<run>/checkpoints/{sft,step}_NNNNNN`` (atomic; ``latest`` points at the
newest complete one)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sapo_megatron.runtime.run_dir import Checkpoint

if TYPE_CHECKING:
    from sapo_megatron.config import RunConfig
    from sapo_megatron.loop.colocation import Colocation, NoColocation
    from sapo_megatron.megatron.train_step import TrainEngine
    from sapo_megatron.weight_sync import WeightSync


@dataclass
class LoopState:
    """Everything besides model/optimizer/RNG that a checkpoint must restore to continue exactly."""

    step: int = 0
    sft_step: int = 0
    prompts: dict[str, Any] = field(default_factory=dict)
    sft_prompts: dict[str, Any] = field(default_factory=dict)
    accuracy_before: float | None = None
    eval_before: dict[str, Any] | None = None
    """The evaluation before RL and the latest one: ``{"step", "datasets"}`` (see ``loop.evaluation``)."""
    eval_last: dict[str, Any] | None = None
    wall_seconds: float = 0.0
    bad_steps: dict[str, int] = field(default_factory=dict)
    distill: dict[str, Any] = field(default_factory=dict)
    """The distillation step's state (the SAF schedule), see ``DistillStep.state_dict``."""


class Checkpointer:
    """Saves the loop (every rank calls it: the engine's state is sharded) and restores it on resume."""

    def __init__(
        self,
        cfg: RunConfig,
        engine: TrainEngine,
        sync: WeightSync,
        colocation: Colocation | NoColocation,
        run_dir: Path,
        started: float,
    ) -> None:
        self.cfg, self.engine, self.sync, self.colocation, self.run_dir = (
            cfg,
            engine,
            sync,
            colocation,
            run_dir,
        )
        self.started = started
        self._saved_at: tuple[int, int] | None = None
        self.attachments: dict[str, Callable[[], bytes | None]] = {}
        """Extra files of a checkpoint, by name: what the main rank's callable returns (``None``: no file), e.g.
        the rollout batch in flight (:mod:`sapo_megatron.loop.pipeline`)."""

    def save(self, state: LoopState, *, phase: str) -> Path | None:
        """A checkpoint of this moment, named after the phase's step; nothing if this moment is saved already."""
        from sapo_megatron.megatron.dist_ckpt import save_train_state

        moment = (state.sft_step, state.step)
        if moment == self._saved_at:
            return None
        extra = asdict(state)
        extra["wall_seconds"] = state.wall_seconds + time.perf_counter() - self.started
        extra["lr_bounds"] = list(self.engine.lr_bounds())  # the schedule's, for loading it back
        name = f"sft_{state.sft_step:06d}" if phase == "sft" else f"step_{state.step:06d}"
        files = {file: data for file, make in self.attachments.items() if (data := make()) is not None}
        with self.colocation.resident():  # colocated: an offloaded trainer comes back for the save
            path = save_train_state(
                self.engine,
                self.run_dir / "checkpoints" / name,
                extra,
                keep=self.cfg.trainer.keep_checkpoints,
                files=files,
            )
        self._saved_at = moment
        return path

    def restore(self, checkpoint: Checkpoint) -> LoopState:
        """Load ``checkpoint`` into the engine; returns the loop state saved with it."""
        from sapo_megatron.megatron.dist_ckpt import load_train_state

        bounds = checkpoint.extra.get("lr_bounds")
        if bounds:  # the parameter groups as saved (an SFT-phase save holds the SFT learning rate)
            self.engine.set_lr_bounds(*bounds)
        extra = load_train_state(self.engine, checkpoint.path)
        extra.pop("lr_bounds", None)
        state = LoopState(**extra)
        cfg = self.cfg
        self.engine.reset_schedule(
            lr=cfg.optimizer.lr,
            total_steps=cfg.trainer.steps * cfg.trainer.mini_batches,
            done=state.step * cfg.trainer.mini_batches,
        )
        self.sync.version = state.step  # weight versions continue: one push before RL, one per step
        self._saved_at = (state.sft_step, state.step)
        return state
