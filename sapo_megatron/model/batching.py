"""Turn samples into the tensors the trainer feeds Megatron: right-padded rows, labels, masks, per-token
rollout log-probs and advantages, split over data-parallel ranks and micro-batches. Pure torch.

Position convention: a sample is ``prompt + response`` (length P + R); the model reads ``seq[:-1]`` and predicts
``seq[1:]``, so response token ``j`` is the label at position ``P - 1 + j``.

MoE routes (R3 routing replay, routing metrics): an engine reports, per sample, int32 ``[P + R - 1, L, k]`` – row
``t`` holds the experts each layer chose for the token at position ``t`` (the last token is never fed). Those are
exactly the ``P + R - 1`` positions the model reads here, so row ``t`` lands on position ``t`` unchanged; padding
positions get ``arange(k) % num_experts`` (distinct experts: a duplicated index would break the dispatcher's split
sizes). Dense layers hold ``-1``.

Two layouts, one source: :func:`position_values` gives a sequence's per-position tensors once (input ids, labels,
loss mask, rollout log-probs, and every ``TrainSequence.token_values`` key – teacher log-probs, say – aligned like
the rollout log-probs); :func:`to_tensors` puts sequence ``i`` in row ``i`` of a right-padded ``[b, s]`` rectangle,
:func:`to_packed_tensors` puts the sequences back to back in one ``[1, T]`` row (see :mod:`sapo_megatron.model.packing`).
A per-token key added in :func:`position_values` therefore follows both layouts, and so do the routes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from sapo_megatron.errors import UserError
from sapo_megatron.model.arch import QwenArch
from sapo_megatron.model.packing import POSITION_IDS, SEGMENT_IDS, plan_packing, slot_length
from sapo_megatron.model.step_batch import MicroBatch, StepBatch

Tensors = dict[str, torch.Tensor]
"""A micro-batch's tensors by name, as laid out before they become a :class:`MicroBatch`."""
Item = TypeVar("Item")

ENGINE_ROUTES = "engine_routes"
"""Micro-batch key of the engine's routes, int32 ``[b, s, L, k]``."""

SEQUENCE_INDEX = "sequence_index"
"""int64 ``[n]``: which of the sequences given to :func:`build_micro_batches` each row (padded) or segment
(packed) of the micro-batch holds."""

_TOKEN_KEYS = ("input_ids", "labels", "loss_mask", "rollout_logp")

NO_ROUTE = -1
"""Route entry of a layer without a router (dense MLP), or of a layer another pipeline stage owns."""


class RoutingReplayError(UserError):
    """Routes that cannot be replayed (missing, short, wrong shape, out of range, repeated experts) or a model /
    layout that routing replay does not support; the message names the sample and the field."""


@dataclass(frozen=True)
class TrainSequence:
    """One sequence to train on. ``rollout_logp`` has one entry per response token (may be empty for SFT).

    ``routed_experts``: the engine's routes, int32 ``[P + R - 1, num_layers, top_k]`` (MoE, when requested);
    ``sample_id`` names the sample in errors (e.g. ``"group 3 sample 1"``). Distillation: ``teacher_logp``, the
    teacher's log-prob of each response token (None: not scored), and ``domain_id``, the prompt's domain as an
    index the distillation step knows (-1: none). ``token_values``: more values per response token, each becoming
    the per-token micro-batch key of its name, aligned like ``rollout_logp``. ``response_mask``: one 0/1 per
    response token (multi-turn episodes: 0 on tool observations, so the loss mask has several spans); None: all 1."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    advantage: float = 0.0
    rollout_logp: Sequence[float] = ()
    routed_experts: np.ndarray | None = field(default=None, compare=False, repr=False)
    sample_id: str | None = None
    teacher_logp: Sequence[float] | None = None
    domain_id: int = -1
    token_values: Mapping[str, Sequence[float]] = field(default_factory=dict, compare=False, repr=False)
    response_mask: Sequence[int] | None = None
    versions: Sequence[int] | None = None
    """The policy version that sampled each response token (fully-async staleness; None: not tracked)."""
    images: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)
    """The prompt's images as the engine saw them: ``pixel_values`` ``[patches, C·T·P·P]`` and ``image_grid_thw``
    ``[images, 3]`` (None: a text prompt)."""


PIXEL_VALUES = "pixel_values"
IMAGE_GRID_THW = "image_grid_thw"
IMAGE_KEYS = (PIXEL_VALUES, IMAGE_GRID_THW)
IMAGE_MASK = "image_mask"
"""Per-token key of sequences with images: 1 on their prompt positions, where their image pads are images (a pad
the policy samples in a response is text, as in the engines); absent when no sequence has images."""
"""Micro-batch keys of the images of its sequences, concatenated in row (padded) or segment (packed) order – the
order in which a VL model meets their image pads."""

TEACHER_LOGP = "teacher_logp"
"""Micro-batch key of the teacher's log-probs, fp32 per token like ``labels`` (0 off the response)."""
UNIT_TEMPERATURE_LOGP = "old_logp_t1"
"""The old-policy log-prob at temperature 1, next to ``old_logp`` when distilling at a rollout temperature ≠ 1."""
VERSIONS = "versions"
"""Micro-batch key of each response token's policy version, int64 per token like ``labels`` (-1 off the
response); present when the sequences carry versions."""
DOMAIN_IDS = "domain_ids"
"""Micro-batch key of the sequences' domain ids, int64 per sequence like ``advantages``."""


@dataclass(frozen=True)
class RouteLayout:
    """What valid routes look like for one model: ``[tokens, num_layers, top_k]``, with distinct experts in
    ``[0, num_experts)`` on the MoE layers ``moe_layers`` (0-based) and anything on dense layers."""

    num_layers: int
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...]

    @classmethod
    def from_arch(cls, arch: QwenArch) -> RouteLayout:
        moe_layers = tuple(i for i, is_moe in enumerate(arch.moe_layer_pattern()) if is_moe)
        if not moe_layers:
            raise RoutingReplayError(
                f"the model ({arch.model_type}, {arch.num_hidden_layers} layers) has no MoE layers: it has no "
                "routes to replay or compare",
                hint="set algorithm.routing_replay: none and rollout.routed_experts: false",
            )
        return cls(arch.num_hidden_layers, arch.num_experts_per_tok, arch.num_experts, moe_layers)

    def padding_row(self) -> np.ndarray:
        """int32 ``[num_layers, top_k]``: distinct valid experts on MoE layers, ``NO_ROUTE`` on dense ones."""
        row = np.full((self.num_layers, self.top_k), NO_ROUTE, dtype=np.int32)
        row[list(self.moe_layers)] = np.arange(self.top_k, dtype=np.int32) % self.num_experts
        return row

    def check(self, routes: np.ndarray | None, rows: int, name: str) -> np.ndarray:
        """``routes`` as int32 ``[rows, num_layers, top_k]``, dense layers set to ``NO_ROUTE``; raises
        :class:`RoutingReplayError` naming ``name`` and the field when they are missing or invalid."""
        where = f"{name}: routed_experts"
        if routes is None:
            raise RoutingReplayError(
                f"{where} is missing (the engine returned no routes for it)",
                hint="request them from the engine: rollout.routed_experts: true",
            )
        routes = np.asarray(routes)
        self._check_shape(routes, rows, where)
        moe = routes[:, list(self.moe_layers)].astype(np.int64)  # range-check before narrowing
        self._check_experts(moe, where)
        out = np.full((rows, self.num_layers, self.top_k), NO_ROUTE, dtype=np.int32)
        out[:, list(self.moe_layers)] = moe
        return out

    def _check_shape(self, routes: np.ndarray, rows: int, where: str) -> None:
        if not np.issubdtype(routes.dtype, np.integer):
            raise RoutingReplayError(f"{where} has dtype {routes.dtype}, expected integers (int32)")
        if routes.ndim != 3 or routes.shape[1:] != (self.num_layers, self.top_k):
            raise RoutingReplayError(
                f"{where} has shape {list(routes.shape)}, expected [{rows}, {self.num_layers} layers, "
                f"{self.top_k} top_k]"
            )
        if routes.shape[0] != rows:
            raise RoutingReplayError(
                f"{where} has {routes.shape[0]} rows, expected {rows} (prompt + response - 1 tokens)"
            )

    def _check_experts(self, moe: np.ndarray, where: str) -> None:
        """``moe`` [rows, MoE layers, k]: every entry a valid expert, distinct within each row."""
        outside = ((moe < 0) | (moe >= self.num_experts)).any(axis=-1)
        ordered = np.sort(moe, axis=-1)
        repeated = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1)
        for bad, problem in (
            (outside, f"has experts outside [0, {self.num_experts})"),
            (repeated, "repeats an expert"),
        ):
            if bad.any():
                row, layer = np.argwhere(bad)[0]
                raise RoutingReplayError(
                    f"{where}[{row}, {self.moe_layers[layer]}] = {moe[row, layer].tolist()} {problem} "
                    "(token row, layer)"
                )


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_length(sequences: Sequence[TrainSequence], multiple: int = 1) -> int:
    """Model input length for these sequences (the longest minus one), rounded up to ``multiple`` (TP for SP)."""
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in sequences)
    return round_up(max(longest - 1, 1), multiple)


def position_values(seq: TrainSequence, name: str = "sequence") -> dict[str, torch.Tensor]:
    """One sequence's values per model position ``[P + R - 1]``: ``input_ids`` / ``labels`` (int64),
    ``loss_mask`` (1 where the label is a response token the policy sampled: ``response_mask``), ``rollout_logp``, ``teacher_logp`` (when scored) and
    each ``token_values`` key (float32, the value of response token ``j`` at position ``P - 1 + j``, 0
    elsewhere)."""
    tokens = torch.tensor([*seq.prompt_ids, *seq.response_ids], dtype=torch.long)
    positions = len(tokens) - 1
    start, count = len(seq.prompt_ids) - 1, len(seq.response_ids)
    loss_mask = torch.zeros(positions, dtype=torch.float32)
    loss_mask[start : start + count] = _response_mask(seq, count, name)
    values = {"input_ids": tokens[:-1], "labels": tokens[1:], "loss_mask": loss_mask}
    if seq.versions is not None:
        values[VERSIONS] = _version_row(seq.versions, positions, start, count, name)
    if seq.images is not None:
        values[IMAGE_MASK] = (torch.arange(positions) < len(seq.prompt_ids)).float()
    per_token_values = {"rollout_logp": seq.rollout_logp, **seq.token_values}
    if seq.teacher_logp is not None:
        if len(seq.teacher_logp) != count:
            raise ValueError(f"{name}: {len(seq.teacher_logp)} teacher log-probs for {count} response tokens")
        per_token_values[TEACHER_LOGP] = seq.teacher_logp
    for key, per_token in per_token_values.items():
        if key in values or key in (
            SEGMENT_IDS,
            POSITION_IDS,
            SEQUENCE_INDEX,
            ENGINE_ROUTES,
            DOMAIN_IDS,
            VERSIONS,
            *IMAGE_KEYS,
        ):
            raise ValueError(f"{name}: token_values key {key!r} is a reserved micro-batch key")
        out = torch.zeros(positions, dtype=torch.float32)
        if len(per_token):
            if len(per_token) != count:
                raise ValueError(f"{name}: {key} has {len(per_token)} values for {count} response tokens")
            out[start : start + count] = torch.tensor(list(per_token), dtype=torch.float32)
        values[key] = out
    return values


def _version_row(versions: Sequence[int], positions: int, start: int, count: int, name: str) -> torch.Tensor:
    if len(versions) != count:
        raise ValueError(f"{name}: {len(versions)} policy versions for {count} response tokens")
    out = torch.full((positions,), -1, dtype=torch.long)
    out[start : start + count] = torch.tensor(list(versions), dtype=torch.long)
    return out


def _response_mask(seq: TrainSequence, count: int, name: str) -> torch.Tensor | float:
    if seq.response_mask is None:
        return 1.0
    mask = torch.tensor(list(seq.response_mask), dtype=torch.float32)
    if len(mask) != count or not ((mask == 0) | (mask == 1)).all():
        raise ValueError(f"{name}: response_mask needs one 0/1 per response token ({count}), got {len(mask)}")
    return mask


def per_sequence_values(sequences: Sequence[TrainSequence]) -> Tensors:
    """``advantages`` fp32 ``[n]``, and ``domain_ids`` int64 ``[n]`` when the sequences were scored by a teacher
    (then every one must have been: a half-scored micro-batch would distil on zeros)."""
    values = {"advantages": torch.tensor([s.advantage for s in sequences], dtype=torch.float32)}
    scored = [s.teacher_logp is not None for s in sequences]
    if any(scored):
        if not all(scored):
            index = scored.index(False)
            name = sequences[index].sample_id or f"sequence {index}"
            raise ValueError(f"{name}: no teacher log-probs, while other sequences of its batch have them")
        values[DOMAIN_IDS] = torch.tensor([s.domain_id for s in sequences], dtype=torch.long)
    values.update(image_values(sequences))
    return values


def image_values(sequences: Sequence[TrainSequence]) -> Tensors:
    """``pixel_values`` and ``image_grid_thw`` of the sequences with images, concatenated in sequence order
    (nothing when none has images). Raises ValueError naming a sequence whose patches do not match its grids."""
    with_images = [(i, s.images) for i, s in enumerate(sequences) if s.images is not None]
    for index, images in with_images:
        seq = sequences[index]
        pixels, grids = images[PIXEL_VALUES], images[IMAGE_GRID_THW]
        if grids.dim() != 2 or grids.shape[1] != 3 or int(grids.prod(-1).sum()) != pixels.shape[0]:
            raise ValueError(
                f"{seq.sample_id or f'sequence {index}'}: {pixels.shape[0]} image patches for image_grid_thw "
                f"{grids.tolist()}"
            )
    if not with_images:
        return {}
    return {key: torch.cat([images[key] for _, images in with_images]) for key in IMAGE_KEYS}


def _pad_value(key: str, pad_id: int) -> int | float:
    if key == VERSIONS:
        return -1
    return pad_id if key in ("input_ids", "labels") else 0


def _dtype(key: str) -> torch.dtype:
    return torch.long if key in ("input_ids", "labels", VERSIONS) else torch.float32


def _keys(rows: Sequence[dict[str, torch.Tensor]]) -> list[str]:
    extra = sorted({key for row in rows for key in row} - set(_TOKEN_KEYS))
    return [*_TOKEN_KEYS, *extra]


def to_tensors(
    sequences: Sequence[TrainSequence],
    length: int,
    pad_id: int,
    route_layout: RouteLayout | None = None,
) -> Tensors:
    """``input_ids``, ``labels``, ``loss_mask``, ``rollout_logp`` (and any ``token_values`` keys) [b, length] and
    ``advantages`` [b]; with ``route_layout`` also ``engine_routes``, int32 ``[b, length, L, k]`` on the CPU (see
    the module docstring; the sequences' routes must already be valid: :func:`check_routes`)."""
    rows = [position_values(seq, seq.sample_id or f"sequence {i}") for i, seq in enumerate(sequences)]
    batch: Tensors = {}
    for key in _keys(rows):
        dtype = _dtype(key)
        out = torch.full((len(rows), length), _pad_value(key, pad_id), dtype=dtype)
        for index, row in enumerate(rows):
            if key not in row:
                continue
            if len(row[key]) > length:
                raise ValueError(
                    f"sequence of {len(row[key]) + 1} tokens does not fit the padded length {length} + 1"
                )
            out[index, : len(row[key])] = row[key]
        batch[key] = out
    batch.update(per_sequence_values(sequences))
    if route_layout is not None:
        batch[ENGINE_ROUTES] = routes_tensor([_routes_of(s) for s in sequences], length, route_layout)
    return batch


def to_packed_tensors(
    sequences: Sequence[TrainSequence],
    length: int,
    pad_id: int,
    multiple: int = 1,
    route_layout: RouteLayout | None = None,
) -> Tensors:
    """The sequences back to back in one row: every per-token key of :func:`to_tensors` as ``[1, length]``,
    sequence ``i`` in a slot of :func:`~sapo_megatron.model.packing.slot_length` tokens (its values, then padding),
    then tail padding; ``position_ids`` (restarting at each slot and at the tail), ``segment_ids`` (``i`` on slot
    ``i``, -1 on the tail), ``advantages`` ``[n]``, and with ``route_layout`` ``engine_routes`` ``[1, length, L,
    k]`` (padding rows at the padding positions)."""
    rows = [position_values(seq, seq.sample_id or f"sequence {i}") for i, seq in enumerate(sequences)]
    slots = [slot_length(len(row["input_ids"]), multiple) for row in rows]
    if sum(slots) > length:
        raise ValueError(
            f"{len(rows)} sequences take {sum(slots)} tokens, more than the packed length {length}"
        )
    batch: Tensors = {}
    for key in _keys(rows):
        dtype = _dtype(key)
        out = torch.full((1, length), _pad_value(key, pad_id), dtype=dtype)
        for row, start in zip(rows, _offsets(slots)):
            if key in row:
                out[0, start : start + len(row[key])] = row[key]
        batch[key] = out
    segment_ids = torch.full((1, length), -1, dtype=torch.long)
    position_ids = torch.zeros((1, length), dtype=torch.long)
    for index, (slot, start) in enumerate(zip(slots, _offsets(slots))):
        segment_ids[0, start : start + slot] = index
        position_ids[0, start : start + slot] = torch.arange(slot)
    position_ids[0, sum(slots) :] = torch.arange(length - sum(slots))
    batch[SEGMENT_IDS], batch[POSITION_IDS] = segment_ids, position_ids
    batch.update(per_sequence_values(sequences))
    if route_layout is not None:
        batch[ENGINE_ROUTES] = _packed_routes(sequences, slots, length, route_layout)
    return batch


def _offsets(slots: Sequence[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(slots)[:-1]]).astype(int).tolist() if slots else []


def _packed_routes(
    sequences: Sequence[TrainSequence], slots: Sequence[int], length: int, layout: RouteLayout
) -> torch.Tensor:
    out = np.broadcast_to(layout.padding_row(), (1, length, layout.num_layers, layout.top_k)).copy()
    for seq, start in zip(sequences, _offsets(slots)):
        routes = _routes_of(seq)
        out[0, start : start + len(routes)] = routes
    return torch.from_numpy(out)


def _routes_of(seq: TrainSequence) -> np.ndarray:
    if seq.routed_experts is None:  # check_routes ran first: every sequence has its routes
        raise RoutingReplayError(f"{seq.sample_id or 'a sequence'}: no routed_experts to replay")
    return seq.routed_experts


def routes_tensor(routes: Sequence[np.ndarray], length: int, layout: RouteLayout) -> torch.Tensor:
    """Right-padded int32 ``[b, length, L, k]`` from per-sequence routes ``[rows ≤ length, L, k]``: row ``t``
    at position ``t``, :meth:`RouteLayout.padding_row` at the padding positions."""
    out = np.broadcast_to(layout.padding_row(), (len(routes), length, layout.num_layers, layout.top_k)).copy()
    for row, seq_routes in enumerate(routes):
        out[row, : len(seq_routes)] = seq_routes
    return torch.from_numpy(out)


def check_routes(sequences: Sequence[TrainSequence], layout: RouteLayout) -> list[TrainSequence]:
    """Every sequence's ``routed_experts`` checked against ``layout`` (see :meth:`RouteLayout.check`); raises
    :class:`RoutingReplayError` naming the first bad one (by ``sample_id``, else its index in ``sequences``)."""
    checked = []
    for index, seq in enumerate(sequences):
        name = seq.sample_id or f"sequence {index}"
        rows = len(seq.prompt_ids) + len(seq.response_ids) - 1
        routes = layout.check(seq.routed_experts, rows, name)
        checked.append(replace(seq, routed_experts=routes))
    return checked


def split_for_rank(
    sequences: Sequence[Item], *, dp_rank: int, dp_size: int, micro_batches: int
) -> list[list[Item]]:
    """This data-parallel rank's contiguous share of ``sequences``, cut into ``micro_batches`` equal parts."""
    rows = len(sequences)
    if rows % (dp_size * micro_batches):
        raise ValueError(
            f"{rows} sequences do not split evenly over {dp_size} data-parallel ranks × {micro_batches} micro-batches"
        )
    per_rank = rows // dp_size
    mine = list(sequences[dp_rank * per_rank : (dp_rank + 1) * per_rank])
    per_micro = per_rank // micro_batches
    return [mine[i * per_micro : (i + 1) * per_micro] for i in range(micro_batches)]


def build_micro_batches(
    sequences: Sequence[TrainSequence],
    *,
    dp_rank: int,
    dp_size: int,
    micro_batches: int,
    pad_id: int,
    length_multiple: int = 1,
    route_layout: RouteLayout | None = None,
    max_tokens_per_micro_batch: int | None = None,
) -> list[MicroBatch]:
    """This rank's typed micro-batches (:class:`~sapo_megatron.model.step_batch.MicroBatch`), each holding ``sequence_index`` (which of ``sequences`` it holds).

    ``max_tokens_per_micro_batch=None``: ``micro_batches`` equal contiguous shares, right-padded rectangles of
    one length computed over *all* ranks' sequences (pipeline stages exchange fixed-shape activations, and every
    rank must agree). Else packed (:mod:`sapo_megatron.model.packing`): as many ``[1, T]`` micro-batches of at most
    that many tokens as the plan needs (the same count on every rank, at least ``micro_batches``), one ``T`` for
    all; each sequence's slot is rounded up to ``length_multiple``.

    With ``route_layout`` (R3 replay or routing metrics), every sequence must carry valid ``routed_experts``
    and each micro-batch gets ``engine_routes`` int32 ``[b, s, L, k]`` (CPU). All sequences are checked on every
    rank, so a bad one raises the same error everywhere instead of leaving the other ranks in a collective."""
    if route_layout is not None:
        sequences = check_routes(sequences, route_layout)
    if max_tokens_per_micro_batch is None:
        length = padded_length(sequences, length_multiple)
        parts = split_for_rank(
            range(len(sequences)), dp_rank=dp_rank, dp_size=dp_size, micro_batches=micro_batches
        )
        layout = partial(to_tensors, length=length, pad_id=pad_id, route_layout=route_layout)
    else:
        plan = plan_packing(
            [slot_length(len(s.prompt_ids) + len(s.response_ids) - 1, length_multiple) for s in sequences],
            max_tokens_per_micro_batch,
            ranks=dp_size,
            min_micro_batches=micro_batches,
            names=[s.sample_id or f"sequence {i}" for i, s in enumerate(sequences)],
        )
        parts = plan.micro_batches[dp_rank]
        layout = partial(
            to_packed_tensors,
            length=plan.length,
            pad_id=pad_id,
            multiple=length_multiple,
            route_layout=route_layout,
        )
    return [
        MicroBatch.of(
            {
                **layout([sequences[i] for i in part]),
                SEQUENCE_INDEX: torch.tensor(list(part), dtype=torch.long),
            }
        )
        for part in parts
    ]


def padding_fraction(sequences: Sequence[TrainSequence], batch: StepBatch, dp_size: int) -> float:
    """The fraction of the positions the model runs that hold no sequence token: ``sequences`` of the whole step
    (all ranks), ``batch`` this rank's micro-batches (every rank runs the same shapes)."""
    real = sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in sequences)
    run = dp_size * sum(micro["input_ids"].numel() for micro in batch.micro_batches())
    return 1.0 - real / max(run, 1)
