"""Turn samples into the tensors the trainer feeds Megatron: right-padded rows, labels, masks, per-token
rollout log-probs and advantages, split over data-parallel ranks and micro-batches. Pure torch.

Position convention: a sample is ``prompt + response`` (length P + R); the model reads ``seq[:-1]`` and predicts
``seq[1:]``, so response token ``j`` is the label at position ``P - 1 + j``.

MoE routes (R3 routing replay, routing metrics): an engine reports, per sample, int32 ``[P + R - 1, L, k]`` – row
``t`` holds the experts each layer chose for the token at position ``t`` (the last token is never fed). Those are
exactly the ``P + R - 1`` positions the model reads here, so row ``t`` lands on position ``t`` unchanged; padding
positions get ``arange(k) % num_experts`` (distinct experts: a duplicated index would break the dispatcher's split
sizes). Dense layers hold ``-1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from sapo_megatron.arch import QwenArch
from sapo_megatron.errors import UserError

MicroBatch = dict[str, torch.Tensor]

ENGINE_ROUTES = "engine_routes"
"""Micro-batch key of the engine's routes, int32 ``[b, s, L, k]``."""

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
    index the distillation step knows (-1: none)."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    advantage: float = 0.0
    rollout_logp: Sequence[float] = ()
    routed_experts: np.ndarray | None = field(default=None, compare=False, repr=False)
    sample_id: str | None = None
    teacher_logp: Sequence[float] | None = None
    domain_id: int = -1


TEACHER_LOGP = "teacher_logp"
"""Micro-batch key of the teacher's log-probs, fp32 ``[b, s]`` aligned with ``labels`` (0 off the response)."""
DOMAIN_IDS = "domain_ids"
"""Micro-batch key of the rows' domain ids, int64 ``[b]``."""


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


def to_tensors(
    sequences: Sequence[TrainSequence],
    length: int,
    pad_id: int,
    route_layout: RouteLayout | None = None,
) -> MicroBatch:
    """``input_ids``, ``labels``, ``loss_mask``, ``rollout_logp`` [b, length] and ``advantages`` [b]; with
    ``route_layout`` also ``engine_routes``, int32 ``[b, length, L, k]`` on the CPU (see the module docstring;
    the sequences' routes must already be valid: :func:`check_routes`); when the sequences were scored by a
    teacher, ``teacher_logp`` [b, length] and ``domain_ids`` [b] (:func:`teacher_tensors`)."""
    rows = len(sequences)
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    labels = torch.full((rows, length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((rows, length), dtype=torch.float32)
    rollout_logp = torch.zeros((rows, length), dtype=torch.float32)
    for row, seq in enumerate(sequences):
        tokens = torch.tensor([*seq.prompt_ids, *seq.response_ids], dtype=torch.long)
        if len(tokens) - 1 > length:
            raise ValueError(f"sequence of {len(tokens)} tokens does not fit the padded length {length} + 1")
        start, count = len(seq.prompt_ids) - 1, len(seq.response_ids)
        input_ids[row, : len(tokens) - 1] = tokens[:-1]
        labels[row, : len(tokens) - 1] = tokens[1:]
        loss_mask[row, start : start + count] = 1.0
        if seq.rollout_logp:
            rollout_logp[row, start : start + count] = torch.tensor(
                list(seq.rollout_logp), dtype=torch.float32
            )
    advantages = torch.tensor([s.advantage for s in sequences], dtype=torch.float32)
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "rollout_logp": rollout_logp,
        "advantages": advantages,
    }
    if route_layout is not None:
        batch[ENGINE_ROUTES] = routes_tensor([s.routed_experts for s in sequences], length, route_layout)
    if any(s.teacher_logp is not None for s in sequences):
        batch.update(teacher_tensors(sequences, length))
    return batch


def teacher_tensors(sequences: Sequence[TrainSequence], length: int) -> MicroBatch:
    """``teacher_logp`` fp32 ``[b, length]`` (response token ``j`` at position ``P - 1 + j``, like
    ``rollout_logp``; 0 elsewhere) and ``domain_ids`` int64 ``[b]``; every sequence must have been scored."""
    teacher_logp = torch.zeros((len(sequences), length), dtype=torch.float32)
    for row, seq in enumerate(sequences):
        if seq.teacher_logp is None or len(seq.teacher_logp) != len(seq.response_ids):
            got = (
                "no teacher log-probs"
                if seq.teacher_logp is None
                else f"{len(seq.teacher_logp)} teacher log-probs"
            )
            raise ValueError(
                f"{seq.sample_id or f'sequence {row}'}: {got} for {len(seq.response_ids)} response tokens"
            )
        start = len(seq.prompt_ids) - 1
        teacher_logp[row, start : start + len(seq.response_ids)] = torch.tensor(
            list(seq.teacher_logp), dtype=torch.float32
        )
    domain_ids = torch.tensor([s.domain_id for s in sequences], dtype=torch.long)
    return {TEACHER_LOGP: teacher_logp, DOMAIN_IDS: domain_ids}


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
    sequences: Sequence[TrainSequence], *, dp_rank: int, dp_size: int, micro_batches: int
) -> list[list[TrainSequence]]:
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
) -> list[MicroBatch]:
    """This rank's micro-batches, all padded to one length computed over *all* ranks' sequences (pipeline
    stages exchange fixed-shape activations, and every rank must agree).

    With ``route_layout`` (R3 replay or routing metrics), every sequence must carry valid ``routed_experts``
    and each micro-batch gets ``engine_routes`` int32 ``[b, s, L, k]`` (CPU). All sequences are checked on every
    rank, so a bad one raises the same error everywhere instead of leaving the other ranks in a collective."""
    if route_layout is not None:
        sequences = check_routes(sequences, route_layout)
    length = padded_length(sequences, length_multiple)
    parts = split_for_rank(sequences, dp_rank=dp_rank, dp_size=dp_size, micro_batches=micro_batches)
    return [to_tensors(part, length, pad_id, route_layout) for part in parts]
