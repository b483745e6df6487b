"""Samples → training tensors: label alignment, padding, data-parallel and micro-batch split."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from sapo_megatron.model.arch import QwenArch
from sapo_megatron.model.batching import (
    RouteLayout,
    RoutingReplayError,
    TrainSequence,
    build_micro_batches,
    padded_length,
    split_for_rank,
    to_packed_tensors,
    to_tensors,
)
from sapo_megatron.model.tiny import tiny_hf_config


def test_response_tokens_are_labels_at_prompt_end():
    seq = TrainSequence([1, 5, 6], [7, 8, 2], advantage=0.5, rollout_logp=[-0.1, -0.2, -0.3])
    batch = to_tensors([seq], length=6, pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7, 8, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7, 8, 2, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 0]]
    # the engine's log-prob of response token j sits where that token is the label
    assert batch["rollout_logp"][0, 2:5].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert batch["advantages"].tolist() == [0.5]


def test_an_episode_gets_a_loss_mask_with_a_span_per_turn_in_both_layouts():
    """prompt [1, 5] | turn [7, 8] | observation [3, 4] | turn [9, 2]: the observation's labels are masked and
    carry rollout log-prob 0; packed and padded agree."""
    seq = TrainSequence(
        [1, 5],
        [7, 8, 3, 4, 9, 2],
        advantage=1.0,
        rollout_logp=[-0.1, -0.2, 0.0, 0.0, -0.3, -0.4],
        response_mask=[1, 1, 0, 0, 1, 1],
    )
    padded = to_tensors([seq, TrainSequence([1], [2])], length=8, pad_id=0)
    assert padded["labels"][0].tolist() == [5, 7, 8, 3, 4, 9, 2, 0]
    assert padded["loss_mask"][0].tolist() == [0, 1, 1, 0, 0, 1, 1, 0]
    assert padded["loss_mask"][1].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert padded["rollout_logp"][0].tolist() == pytest.approx([0, -0.1, -0.2, 0, 0, -0.3, -0.4, 0])
    packed = to_packed_tensors([TrainSequence([1], [2]), seq], length=10, pad_id=0)
    assert packed["loss_mask"][0].tolist() == [1, 0, 1, 1, 0, 0, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="group 0 sample 1: response_mask needs one 0/1 per response token"):
        to_tensors([replace(seq, response_mask=[1, 0], sample_id="group 0 sample 1")], length=8, pad_id=0)


def test_policy_versions_ride_on_the_response_tokens_in_both_layouts():
    """A partial rollout's tokens carry the versions that sampled them: int64 where the token is the label, -1 on
    prompts, padding and the other layout's gaps; a count that does not match is named."""
    seq = TrainSequence(
        [1, 5], [7, 8, 9], rollout_logp=[-0.1, -0.2, -0.3], versions=[3, 3, 4], sample_id="g1 s0"
    )
    padded = to_tensors([seq, TrainSequence([1], [2], versions=[4])], length=5, pad_id=0)
    assert padded["versions"].dtype == torch.long
    assert padded["versions"].tolist() == [[-1, 3, 3, 4, -1], [4, -1, -1, -1, -1]]
    packed = to_packed_tensors([TrainSequence([1], [2], versions=[4]), seq], length=7, pad_id=0)
    assert packed["versions"].tolist() == [[4, -1, 3, 3, 4, -1, -1]]
    micro = build_micro_batches([seq], dp_rank=0, dp_size=1, micro_batches=1, pad_id=0)
    assert micro[0].versions is not None and micro[0].versions.tolist() == [[-1, 3, 3, 4]]
    with pytest.raises(ValueError, match="g1 s0: 2 policy versions for 3 response tokens"):
        to_tensors([replace(seq, versions=[3, 3])], length=5, pad_id=0)


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


# ---------------------------------------------------------------- MoE routes (R3 replay, routing metrics)
LAYOUT = RouteLayout(num_layers=3, top_k=2, num_experts=4, moe_layers=(0, 2))  # layer 1 is dense


def routes_for(seq_len: int, offset: int = 0) -> np.ndarray:
    """Distinct valid experts per row, different per row: ``[seq_len - 1, 3, 2]``, dense layer -1."""
    rows = np.arange(seq_len - 1)[:, None, None]
    routes = np.concatenate([(rows + offset) % 4, (rows + offset + 1) % 4], axis=-1).repeat(3, axis=1)
    routes[:, 1] = -1
    return routes.astype(np.int32)


def test_engine_routes_land_on_the_positions_the_model_reads():
    seqs = [
        TrainSequence([1, 5, 6], [7, 8, 2], routed_experts=routes_for(6), sample_id="group 0 sample 0"),
        TrainSequence([3], [4, 9], routed_experts=routes_for(3, offset=1), sample_id="group 0 sample 1"),
    ]
    (batch,) = build_micro_batches(seqs, dp_rank=0, dp_size=1, micro_batches=1, pad_id=0, route_layout=LAYOUT)
    routes = batch["engine_routes"]
    assert routes.dtype == torch.int32 and routes.device.type == "cpu"
    assert routes.shape == (2, 5, 3, 2)  # [b, s = longest - 1, layers, k]
    # row t of the engine's routes is the token at input position t (input_ids = tokens[:-1])
    assert batch["input_ids"][0].tolist() == [1, 5, 6, 7, 8]
    assert torch.equal(routes[0], torch.from_numpy(routes_for(6)))
    assert torch.equal(routes[1, :2], torch.from_numpy(routes_for(3, offset=1)))
    # padding positions: distinct valid experts on MoE layers, -1 on the dense layer
    assert routes[1, 2:, 0].tolist() == [[0, 1]] * 3 and routes[1, 2:, 2].tolist() == [[0, 1]] * 3
    assert (routes[:, :, 1] == -1).all()


def test_routes_follow_the_data_parallel_split_and_padding_multiple():
    seqs = [TrainSequence([i + 1], [2, 3, 4], routed_experts=routes_for(4, offset=i)) for i in range(4)]
    rank1 = build_micro_batches(
        seqs, dp_rank=1, dp_size=2, micro_batches=2, pad_id=0, length_multiple=4, route_layout=LAYOUT
    )
    assert [b["engine_routes"].shape for b in rank1] == [torch.Size([1, 4, 3, 2])] * 2
    assert torch.equal(rank1[1]["engine_routes"][0, :3], torch.from_numpy(routes_for(4, offset=3)))
    assert rank1[1]["engine_routes"][0, 3, 0].tolist() == [0, 1]


def test_without_a_route_layout_routes_are_ignored():
    seqs = [TrainSequence([1], [2, 3], routed_experts=routes_for(3))]
    (batch,) = build_micro_batches(seqs, dp_rank=0, dp_size=1, micro_batches=1, pad_id=0)
    assert "engine_routes" not in batch


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        (None, "group 2 sample 1: routed_experts is missing"),
        (routes_for(5)[:-1], r"has 3 rows, expected 4 \(prompt \+ response - 1 tokens\)"),
        (routes_for(5)[:, :2], r"has shape \[4, 2, 2\], expected \[4, 3 layers, 2 top_k\]"),
        (np.zeros((4, 3, 2), dtype=np.float32), "has dtype float32"),
        (
            np.where(np.arange(2) == 1, 4, routes_for(5)),
            r"routed_experts\[0, 0\] = \[.*\] has experts outside \[0, 4\)",
        ),
        (np.full((4, 3, 2), -1, dtype=np.int32), r"has experts outside \[0, 4\)"),
        (np.zeros((4, 3, 2), dtype=np.int32), r"routed_experts\[0, 0\] = \[0, 0\] repeats an expert"),
    ],
    ids=["missing", "short", "layers", "dtype", "out-of-range", "all-minus-one", "repeated"],
)
def test_bad_routes_are_refused_naming_the_sample_and_field(routes, message):
    good = TrainSequence([1, 2], [3, 4], routed_experts=routes_for(4), sample_id="group 2 sample 0")
    bad = TrainSequence([1, 2], [3, 4, 5], routed_experts=routes, sample_id="group 2 sample 1")
    with pytest.raises(RoutingReplayError, match=message) as info:
        build_micro_batches([good, bad], dp_rank=0, dp_size=1, micro_batches=1, pad_id=0, route_layout=LAYOUT)
    assert "group 2 sample 1: routed_experts" in str(info.value)


def test_bad_routes_of_another_rank_are_refused_on_every_rank():
    """Each rank checks all sequences, so every rank raises instead of some waiting in a collective."""
    seqs = [TrainSequence([1], [2, 3], routed_experts=routes_for(3)) for _ in range(3)]
    seqs.append(TrainSequence([1], [2, 3], routed_experts=None))
    with pytest.raises(RoutingReplayError, match="sequence 3: routed_experts is missing"):
        build_micro_batches(seqs, dp_rank=0, dp_size=2, micro_batches=1, pad_id=0, route_layout=LAYOUT)


def test_route_layout_from_arch():
    layout = RouteLayout.from_arch(QwenArch.from_hf_dict(tiny_hf_config("moe", mlp_only_layers=[1])))
    assert layout == RouteLayout(num_layers=2, top_k=2, num_experts=8, moe_layers=(0,))
    assert layout.padding_row().tolist() == [[0, 1], [-1, -1]]
    with pytest.raises(RoutingReplayError, match="no MoE layers"):
        RouteLayout.from_arch(QwenArch.from_hf_dict(tiny_hf_config("dense")))
