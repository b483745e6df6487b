"""The async pipeline's batch in flight inside a training-state checkpoint: the file's name, and whether a
checkpoint holds one. The pipeline (:mod:`.pipeline`) writes and reads the file; the session asks whether a
resumed run trains on a batch it already generated (its samples were logged before the stop)."""

from __future__ import annotations

from pathlib import Path

from sapo_megatron.runtime.run_dir import Checkpoint

IN_FLIGHT_FILE = "rollout_in_flight.pt"
"""The batch in flight, inside a training-state checkpoint (written by the main rank, read on resume)."""


def holds_batch_in_flight(checkpoint: Checkpoint | None) -> bool:
    """Whether ``checkpoint`` (a run directory's checkpoint, with ``path``; or ``None``) holds the batch in flight."""
    return checkpoint is not None and (Path(checkpoint.path) / IN_FLIGHT_FILE).is_file()
