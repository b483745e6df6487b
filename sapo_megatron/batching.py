"""Turn samples into the tensors the trainer feeds Megatron: right-padded rows, labels, masks, per-token
rollout log-probs and advantages, split over data-parallel ranks and micro-batches. Pure torch.

Position convention: a sample is ``prompt + response`` (length P + R); the model reads ``seq[:-1]`` and predicts
``seq[1:]``, so response token ``j`` is the label at position ``P - 1 + j``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MicroBatch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class TrainSequence:
    """One sequence to train on. ``rollout_logp`` has one entry per response token (may be empty for SFT)."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    advantage: float = 0.0
    rollout_logp: Sequence[float] = ()


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_length(sequences: Sequence[TrainSequence], multiple: int = 1) -> int:
    """Model input length for these sequences (the longest minus one), rounded up to ``multiple`` (TP for SP)."""
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in sequences)
    return round_up(max(longest - 1, 1), multiple)


def to_tensors(sequences: Sequence[TrainSequence], length: int, pad_id: int) -> MicroBatch:
    """``input_ids``, ``labels``, ``loss_mask``, ``rollout_logp`` [b, length] and ``advantages`` [b]."""
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
    return {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "rollout_logp": rollout_logp,
        "advantages": advantages,
    }


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
) -> list[MicroBatch]:
    """This rank's micro-batches, all padded to one length computed over *all* ranks' sequences (pipeline
    stages exchange fixed-shape activations, and every rank must agree)."""
    length = padded_length(sequences, length_multiple)
    parts = split_for_rank(sequences, dp_rank=dp_rank, dp_size=dp_size, micro_batches=micro_batches)
    return [to_tensors(part, length, pad_id) for part in parts]
