"""The step as typed data: one :class:`StepBatch` of typed :class:`MicroBatch` es, to which each pass of an RL
step adds the part it computes.

:func:`~sapo_megatron.model.batching.build_micro_batches` fills a micro-batch's sequence tensors (ids, labels,
masks, rollout log-probs, advantages; packing; vision inputs; teacher log-probs; engine routes); every later value
is an optional part that a pass *returns* as a :class:`StepPart` and the step applies
(:meth:`StepBatch.add`): old-policy log-probs, reference log-probs, fused teacher advantages, image-token masks.
The passes and their order live in one list in :mod:`sapo_megatron.loop.trainer` (``STEP_PASSES``);
docs/architecture.md ("Life of a step") shows them.

Megatron's side (:mod:`sapo_megatron.megatron.train_step`, routing replay, packed sequences) reads a micro-batch
through its mapping view – field name → tensor, unset fields absent – and the engine's route recording writes
``recorded_routes`` / ``used_routes`` through it; everything above the engine reads and sets fields.
A part this module does not know (a new capability, or a test's) rides in :meth:`MicroBatch.set_part` /
:meth:`MicroBatch.part`, keyed by its type.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar

import torch

Part = TypeVar("Part")

_EXCLUDED = ("extra", "parts")


@dataclass(eq=False)
class MicroBatch(MutableMapping[str, torch.Tensor]):
    """One micro-batch of a step. Per-token tensors are ``[b, s]`` (packed: ``[1, T]``), per-sequence ones ``[n]``.

    Every field is optional (a loss test's batch holds what its loss reads); :func:`build_micro_batches` fills
    the sequences' ones. Sequences (:mod:`~sapo_megatron.model.batching`): ``input_ids``, ``labels`` (int64), ``loss_mask`` (1 on the
    response tokens the policy sampled: an episode's mask has several spans), ``rollout_logp``, ``advantages``
    (``[n]``, or ``[b, s]`` once teacher advantages are fused in), ``sequence_index``; packed: ``segment_ids``,
    ``position_ids``; vision: ``pixel_values``, ``image_grid_thw``, ``image_mask``; distillation: ``teacher_logp``,
    ``domain_ids``; asynchronous rollouts: ``versions`` (int64 per token: the policy version that sampled it, -1
    off the response); MoE: ``engine_routes`` (int32 ``[b, s, L, k]``); the step's loss normalisers
    ``num_sequences_global`` / ``num_tokens_global``; ``extra``: ``TrainSequence.token_values`` keys.

    Parts the passes add: ``old_logp`` and ``old_logp_t1`` (old policy, at the rollout temperature and at 1),
    ``ref_logp`` (reference policy), ``recorded_routes`` / ``used_routes`` (written by the engine's route
    recording), ``image_token_mask`` (the routing metrics' image positions), ``staleness`` (fp32 per token: the trainer's
    version minus ``versions`` on the response, 0 elsewhere)."""

    input_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    rollout_logp: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    sequence_index: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image_mask: torch.Tensor | None = None
    teacher_logp: torch.Tensor | None = None
    domain_ids: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    engine_routes: torch.Tensor | None = None
    num_sequences_global: torch.Tensor | None = None
    num_tokens_global: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    old_logp_t1: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    recorded_routes: torch.Tensor | None = None
    used_routes: torch.Tensor | None = None
    image_token_mask: torch.Tensor | None = None
    staleness: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    parts: dict[type, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> MicroBatch:
        """A micro-batch from tensors by name (known names become fields, others ``extra``); itself if it is one."""
        if isinstance(tensors, MicroBatch):
            return tensors
        batch = cls()
        for name, value in tensors.items():
            batch[name] = value
        return batch

    def copy(self, **changes: torch.Tensor) -> MicroBatch:
        """A shallow copy (tensors shared) with ``changes`` set."""
        out = MicroBatch.of(dict(self))
        out.parts = dict(self.parts)
        for name, value in changes.items():
            out[name] = value
        return out

    def set_part(self, part: object) -> None:
        """Attach a part of a type this class does not name (one per type)."""
        self.parts[type(part)] = part

    def part(self, kind: type[Part]) -> Part | None:
        """The attached part of type ``kind``, or None."""
        return self.parts.get(kind)

    # ---------------------------------------------------------------- the mapping view (Megatron's side)
    def __getitem__(self, name: str) -> torch.Tensor:
        value = getattr(self, name, None) if name in _FIELDS else self.extra.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if name in _FIELDS:
            setattr(self, name, value)
        else:
            self.extra[name] = value

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        if name in _FIELDS:
            setattr(self, name, None)
        else:
            del self.extra[name]

    def __iter__(self) -> Iterator[str]:
        yield from (name for name in _FIELDS if getattr(self, name) is not None)
        yield from self.extra

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        return getattr(self, name, None) is not None if name in _FIELDS else name in self.extra

    def __repr__(self) -> str:
        shapes = {name: list(value.shape) for name, value in self.items()}
        return f"MicroBatch({shapes}, parts={[kind.__name__ for kind in self.parts]})"


_FIELDS = tuple(f.name for f in fields(MicroBatch) if f.name not in _EXCLUDED)


@dataclass
class StepBatch:
    """One RL step's training data on this rank: ``updates[i]`` the micro-batches of optimizer update ``i``."""

    updates: list[list[MicroBatch]]

    def micro_batches(self) -> list[MicroBatch]:
        """Every micro-batch of the step, update after update."""
        return [batch for update in self.updates for batch in update]

    def add(self, part: StepPart) -> dict[str, float]:
        """Apply ``part`` to the micro-batches; its step metrics."""
        part.apply(self)
        return dict(part.metrics)


class StepPart(Protocol):
    """What a pass returns: values for the micro-batches (applied by :meth:`apply`) and the step's metrics
    (already reduced over every rank: identical everywhere)."""

    @property
    def metrics(self) -> Mapping[str, float]: ...

    def apply(self, batch: StepBatch) -> None: ...


def set_per_micro_batch(batch: StepBatch, name: str, values: Sequence[torch.Tensor | None] | None) -> None:
    """``values[i]`` into field ``name`` of the step's ``i``-th micro-batch (None: this rank has none – not the last
    pipeline stage – or this micro-batch keeps its value)."""
    if values is None:
        return
    micro = batch.micro_batches()
    if len(values) != len(micro):
        raise ValueError(f"{len(values)} values of {name!r} for {len(micro)} micro-batches")
    for target, value in zip(micro, values):
        if value is not None:
            target[name] = value


def last_stage_outputs(per_update: Sequence[list[torch.Tensor] | None]) -> list[torch.Tensor] | None:
    """A forward-only pass's outputs, one per micro-batch of the step (every update's in order), or None on a
    pipeline stage without outputs (not the last). Every stage runs every update's schedule before this."""
    flat: list[torch.Tensor] = []
    for outputs in per_update:
        if outputs is None:
            return None
        flat += outputs
    return flat
