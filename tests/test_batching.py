"""Samples → training tensors: label alignment, padding, data-parallel and micro-batch split."""

from __future__ import annotations

import pytest
import torch

from sapo_megatron.batching import (
    TrainSequence,
    build_micro_batches,
    padded_length,
    split_for_rank,
    to_tensors,
)


def test_response_tokens_are_labels_at_prompt_end():
    seq = TrainSequence([1, 5, 6], [7, 8, 2], advantage=0.5, rollout_logp=[-0.1, -0.2, -0.3])
    batch = to_tensors([seq], length=6, pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7, 8, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7, 8, 2, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 0]]
    # the engine's log-prob of response token j sits where that token is the label
    assert batch["rollout_logp"][0, 2:5].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert batch["advantages"].tolist() == [0.5]


def test_padded_length_rounds_up_for_sequence_parallel():
    seqs = [TrainSequence([1, 2], [3]), TrainSequence([1, 2, 3, 4], [5, 6])]
    assert padded_length(seqs) == 5
    assert padded_length(seqs, multiple=4) == 8


def test_sequence_longer_than_length_is_an_error():
    with pytest.raises(ValueError, match="does not fit"):
        to_tensors([TrainSequence([1, 2, 3], [4, 5])], length=3, pad_id=0)


def test_split_for_rank_is_contiguous_and_even():
    seqs = [TrainSequence([i], [i + 1]) for i in range(8)]
    parts = split_for_rank(seqs, dp_rank=1, dp_size=2, micro_batches=2)
    assert [[s.prompt_ids[0] for s in part] for part in parts] == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="do not split evenly"):
        split_for_rank(seqs, dp_rank=0, dp_size=3, micro_batches=1)


def test_all_ranks_share_one_padded_length():
    seqs = [
        TrainSequence([1], [2]),
        TrainSequence([1], [2]),
        TrainSequence([1, 2, 3, 4, 5], [6]),
        TrainSequence([1], [2]),
    ]
    rank0 = build_micro_batches(seqs, dp_rank=0, dp_size=2, micro_batches=1, pad_id=0)
    rank1 = build_micro_batches(seqs, dp_rank=1, dp_size=2, micro_batches=1, pad_id=0)
    assert rank0[0]["input_ids"].shape == rank1[0]["input_ids"].shape == torch.Size([2, 5])
