"""The typed step (``model/step_batch.py``): a micro-batch's fields and its mapping view for Megatron's side, parts
applied by the step, and passes that run every update's schedule on every pipeline stage."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sapo_megatron.loop.old_policy import OldPolicyLogp, old_policy_logp
from sapo_megatron.loop.reference import reference_logp
from sapo_megatron.model.step_batch import MicroBatch, StepBatch, last_stage_outputs, set_per_micro_batch


def _micro(rows: int = 2, length: int = 3) -> MicroBatch:
    return MicroBatch(
        input_ids=torch.zeros(rows, length, dtype=torch.long), loss_mask=torch.ones(rows, length)
    )


def test_fields_read_as_a_mapping_and_unknown_names_ride_in_extra():
    batch = MicroBatch.of(
        {"input_ids": torch.ones(1, 2), "loss_mask": torch.ones(1, 2), "teacher": torch.zeros(2)}
    )
    assert set(batch) == {"input_ids", "loss_mask", "teacher"} and len(batch) == 3
    assert batch.extra["teacher"] is batch["teacher"] and "old_logp" not in batch
    batch["recorded_routes"] = torch.zeros(1, 2, 3, 2, dtype=torch.int32)  # the engine's route recording
    assert batch.recorded_routes is not None and "recorded_routes" in batch
    del batch["recorded_routes"]
    assert batch.recorded_routes is None
    with pytest.raises(KeyError):
        batch["old_logp"]
    copy = batch.copy(old_logp=torch.ones(1, 2))
    assert copy.old_logp is not None and batch.old_logp is None and copy.input_ids is batch.input_ids
    assert MicroBatch.of(batch) is batch


def test_parts_apply_per_micro_batch_and_typed_parts_ride_by_type():
    step = StepBatch([[_micro(), _micro()], [_micro()]])
    logp = [torch.full((2, 3), float(i)) for i in range(3)]
    assert step.add(OldPolicyLogp(logp, metrics={"x": 1.0})) == {"x": 1.0}
    assert [float(b.old_logp[0, 0]) for b in step.micro_batches()] == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="2 values of 'ref_logp' for 3 micro-batches"):
        set_per_micro_batch(step, "ref_logp", logp[:2])
    set_per_micro_batch(step, "ref_logp", None)  # a stage without outputs: nothing changes
    assert all(b.ref_logp is None for b in step.micro_batches())
    marker = SimpleNamespace(kind="made-up")
    step.micro_batches()[0].set_part(marker)
    assert (
        step.micro_batches()[0].part(SimpleNamespace) is marker
        and step.micro_batches()[1].part(SimpleNamespace) is None
    )


class _Stage:
    """A pipeline stage's forward-only: counts the schedules it ran; outputs only on the last stage."""

    def __init__(self, last: bool) -> None:
        self.last, self.schedules = last, 0

    def forward_only(self, update, output_fn, **kwargs):
        self.schedules += 1
        return [torch.zeros(b.input_ids.shape) for b in update] if self.last else None


@pytest.mark.parametrize("last", [True, False])
def test_forward_passes_run_every_updates_schedule_on_every_stage(last):
    """Pipeline stages exchange activations per schedule: a stage without outputs must still run each update's."""
    step = StepBatch([[_micro()], [_micro(), _micro()], [_micro()]])
    routing = _Stage(last)
    old = old_policy_logp(routing, step, temperature=1.0, unit_temperature=False)  # type: ignore[arg-type]
    reference = _Stage(last)
    ref = reference_logp(reference, step, temperature=1.0)  # type: ignore[arg-type]
    assert routing.schedules == reference.schedules == 3
    assert (old.logp is None, ref.logp is None) == (not last, not last)
    if last:
        assert len(old.logp) == len(ref.logp) == 4
    assert last_stage_outputs([[torch.ones(1)], None]) is None
