"""Sequence packing, pure parts: the plan (first-fit-decreasing sized, balanced, equal counts per rank) against
hand-worked examples and invariants over random lengths; the packed layout of a micro-batch, value by value;
the per-sequence view that undoes it (equal to the padded layout, differentiable); the config field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.model.batching import (
    SEQUENCE_INDEX,
    RouteLayout,
    RoutingReplayError,
    TrainSequence,
    build_micro_batches,
    padding_fraction,
    to_packed_tensors,
    to_tensors,
)
from sapo_megatron.model.packing import (
    POSITION_IDS,
    SEGMENT_IDS,
    PackingError,
    SequenceView,
    plan_packing,
    sequences_with_tokens,
    slot_length,
)
from sapo_megatron.model.step_batch import StepBatch
from sapo_megatron.model.tiny import tiny_hf_config


# ---------------------------------------------------------------- the plan
def test_ffd_count_then_least_loaded_balances_the_micro_batches():
    # slots 5 3 8 2 7 4, budget 10: FFD needs 3 micro-batches ([8,2] [7,3] [5,4]); onto the least-loaded of
    # 3, longest first: 8 | 7 | 5, 4 → 5+4, 3 → 7+3, 2 → 8+2: loads 10 10 9 either way (first-fit kept: ties)
    plan = plan_packing([5, 3, 8, 2, 7, 4], 10, ranks=1)
    assert plan.micro_batches == [[[2, 3], [1, 4], [0, 5]]]
    assert plan.length == 10


def test_counts_round_up_to_the_data_parallel_size_and_ranks_get_equal_counts():
    # 2 ranks: 4 micro-batches. First-fit: 8+2 | 7+3 | 5+4 | - (heaviest 10); least-loaded: 8 | 7 | 5+2 | 4+3
    # (heaviest 8) wins. Dealt heaviest first to the rank with fewer tokens: r0 8, r1 7, r1 +7, r0 +7.
    plan = plan_packing([5, 3, 8, 2, 7, 4], 10, ranks=2)
    assert plan.micro_batches == [[[2], [1, 5]], [[4], [0, 3]]]
    assert plan.length == 8
    assert plan.loads([5, 3, 8, 2, 7, 4]) == [[8, 7], [7, 7]]


def test_first_fit_is_kept_when_least_loaded_does_not_fit():
    # 5 5 4 3 3 into 2 micro-batches of 10: least-loaded gives 5+4 | 5+3 and the last 3 fits nowhere;
    # first-fit-decreasing packs 5+5 | 4+3+3
    plan = plan_packing([5, 5, 4, 3, 3], 10, ranks=1)
    assert plan.micro_batches == [[[0, 1], [2, 3, 4]]]
    assert plan.length == 10


def test_at_least_micro_batches_per_rank_and_empty_ones_when_sequences_run_out():
    assert plan_packing([3, 3], 10, ranks=1, min_micro_batches=2).micro_batches == [[[0], [1]]]
    plan = plan_packing([3, 2], 10, ranks=4)
    assert plan.micro_batches == [[[0]], [[1]], [[]], [[]]]
    assert plan.length == 3


def test_a_sequence_longer_than_the_budget_is_refused_by_name():
    with pytest.raises(
        PackingError, match=r"group 0 sample 1 takes 12 tokens.*max_tokens_per_micro_batch=10"
    ):
        plan_packing([4, 12], 10, ranks=1, names=["group 0 sample 0", "group 0 sample 1"])


@pytest.mark.parametrize("seed", range(20))
def test_plan_invariants_on_random_lengths(seed):
    gen = np.random.default_rng(seed)
    slots = (gen.lognormal(3.0, 1.0, size=int(gen.integers(1, 60))).astype(int) + 1).tolist()
    budget = max(slots) + int(gen.integers(0, 200))
    ranks, minimum = int(gen.integers(1, 5)), int(gen.integers(1, 4))
    plan = plan_packing(slots, budget, ranks=ranks, min_micro_batches=minimum)
    placed = sorted(i for rank in plan.micro_batches for mb in rank for i in mb)
    assert placed == list(range(len(slots)))  # every sequence exactly once
    counts = {len(rank) for rank in plan.micro_batches}
    assert len(plan.micro_batches) == ranks and len(counts) == 1 and counts.pop() >= minimum
    loads = [load for rank in plan.loads(slots) for load in rank]
    assert max(loads) == plan.length <= budget
    # as few micro-batches as first-fit-decreasing needs, rounded up to the ranks (or the minimum)
    ffd = plan_packing(slots, budget, ranks=1).micro_batches[0]
    assert len(loads) == -(-max(len(ffd), ranks * minimum) // ranks) * ranks


def test_slot_length_rounds_up_to_the_multiple_and_takes_at_least_one_token():
    assert [slot_length(n, 4) for n in (0, 1, 4, 5)] == [4, 4, 4, 8]
    assert slot_length(7) == 7


# ---------------------------------------------------------------- the packed layout
LAYOUT = RouteLayout(num_layers=2, top_k=2, num_experts=4, moe_layers=(0,))  # layer 1 dense


def _routes(rows: int, offset: int) -> np.ndarray:
    out = np.full((rows, 2, 2), -1, dtype=np.int32)
    out[:, 0, 0] = (np.arange(rows) + offset) % 4
    out[:, 0, 1] = (np.arange(rows) + offset + 1) % 4
    return out


SEQS = [
    TrainSequence(
        [1, 5, 6],
        [7, 8],
        advantage=0.5,
        rollout_logp=[-0.1, -0.2],
        routed_experts=_routes(4, 0),
        teacher_logp=[-1.0, -2.0],
        domain_id=1,
    ),
    TrainSequence(
        [3],
        [4, 9],
        advantage=-1.0,
        rollout_logp=[-0.3, -0.4],
        routed_experts=_routes(2, 2),
        teacher_logp=[-3.0, -4.0],
        domain_id=0,
    ),
]


def test_packed_layout_value_by_value():
    """Slots of 4 and 2 tokens rounded up to multiple 4 → 4 + 4, then 2 tokens of tail padding."""
    batch = to_packed_tensors(SEQS, length=10, pad_id=0, multiple=4, route_layout=LAYOUT)
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7, 3, 4, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7, 8, 4, 9, 0, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 0, 0, 0, 0]]
    assert batch["rollout_logp"][0].tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3, -0.4, 0, 0, 0, 0])
    assert batch["teacher_logp"][0].tolist() == [0, 0, -1, -2, -3, -4, 0, 0, 0, 0]
    assert batch[POSITION_IDS].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]
    assert batch[SEGMENT_IDS].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, -1, -1]]
    assert batch["advantages"].tolist() == [0.5, -1.0]
    assert batch["domain_ids"].tolist() == [1, 0]
    routes = batch["engine_routes"]
    assert routes.shape == (1, 10, 2, 2)
    assert routes[0, :4, 0].tolist() == _routes(4, 0)[:, 0].tolist()
    assert routes[0, 4:6, 0].tolist() == _routes(2, 2)[:, 0].tolist()
    assert routes[0, 6:, 0].tolist() == [[0, 1]] * 4  # padding: distinct valid experts
    assert (routes[0, :, 1] == -1).all()


def test_sequence_view_of_a_packed_batch_is_the_padded_batch():
    packed = to_packed_tensors(SEQS, length=10, pad_id=0, multiple=4, route_layout=LAYOUT)
    padded = to_tensors(SEQS, length=4, pad_id=0, route_layout=LAYOUT)
    view = SequenceView(packed)
    assert view.shape == (2, 4)
    for key in ("input_ids", "labels", "loss_mask", "rollout_logp", "teacher_logp"):
        torch.testing.assert_close(view(packed[key]), padded[key], rtol=0, atol=0)
    # the padded view has 4 columns; position 3 of the second sequence is its slot padding, like padded's
    torch.testing.assert_close(view(packed["engine_routes"]), padded["engine_routes"], rtol=0, atol=0)
    assert SequenceView(padded)(padded["labels"]) is padded["labels"]
    assert int(sequences_with_tokens(packed)) == int(sequences_with_tokens(padded)) == 2
    empty = to_packed_tensors([], length=4, pad_id=0)  # a rank with fewer sequences than micro-batches
    view = SequenceView(empty)
    assert view(empty["loss_mask"]).tolist() == [[0.0]]  # one row without tokens, as padded would have
    assert view.per_sequence(empty["advantages"]).tolist() == [0.0]
    assert int(sequences_with_tokens(empty)) == 0


def test_sequence_view_carries_the_gradient_back_to_packed_positions():
    packed = to_packed_tensors(SEQS, length=10, pad_id=0, multiple=4)
    x = torch.arange(10, dtype=torch.float32)[None].requires_grad_()
    weights = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    (SequenceView(packed)(x) * weights).sum().backward()
    assert x.grad.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 0, 0]]  # the tail gets nothing


def test_packed_micro_batches_cover_every_sequence_once_with_one_length():
    gen = np.random.default_rng(0)
    seqs = [
        TrainSequence(
            gen.integers(1, 9, size=int(gen.integers(2, 6))).tolist(), [1] * int(gen.integers(1, 30))
        )
        for _ in range(12)
    ]
    built = [
        build_micro_batches(
            seqs,
            dp_rank=rank,
            dp_size=2,
            micro_batches=2,
            pad_id=0,
            length_multiple=2,
            max_tokens_per_micro_batch=40,
        )
        for rank in (0, 1)
    ]
    indices = sorted(i for rank in built for mb in rank for i in mb[SEQUENCE_INDEX].tolist())
    assert indices == list(range(12))
    shapes = {tuple(mb["input_ids"].shape) for rank in built for mb in rank}
    assert len(shapes) == 1 and shapes.pop()[0] == 1
    assert len(built[0]) == len(built[1]) >= 2
    for rank in built:
        for mb in rank:
            lengths = [len(seqs[i].prompt_ids) + len(seqs[i].response_ids) - 1 for i in mb[SEQUENCE_INDEX]]
            assert int((mb[SEGMENT_IDS] >= 0).sum()) == sum(slot_length(n, 2) for n in lengths)


def test_packed_micro_batches_check_routes_and_token_values():
    bad = TrainSequence([1, 2], [3], routed_experts=np.zeros((2, 2, 2), dtype=np.int32), sample_id="s9")
    with pytest.raises(RoutingReplayError, match="s9: routed_experts"):
        build_micro_batches(
            [bad],
            dp_rank=0,
            dp_size=1,
            micro_batches=1,
            pad_id=0,
            route_layout=LAYOUT,
            max_tokens_per_micro_batch=8,
        )
    short = TrainSequence([1, 2], [3, 4], token_values={"noise": [-1.0]}, sample_id="s3")
    with pytest.raises(ValueError, match="s3: noise has 1 values for 2 response tokens"):
        build_micro_batches(
            [short], dp_rank=0, dp_size=1, micro_batches=1, pad_id=0, max_tokens_per_micro_batch=8
        )
    short_teacher = TrainSequence([1, 2], [3, 4], teacher_logp=[-1.0], sample_id="s4")
    with pytest.raises(ValueError, match="s4: 1 teacher log-probs for 2 response tokens"):
        build_micro_batches(
            [short_teacher], dp_rank=0, dp_size=1, micro_batches=1, pad_id=0, max_tokens_per_micro_batch=8
        )
    unscored = TrainSequence([1, 2], [3], sample_id="s5")
    with pytest.raises(
        ValueError, match="s5: no teacher log-probs, while other sequences of its batch have them"
    ):
        to_packed_tensors([SEQS[0], unscored], length=16, pad_id=0)
    reserved = TrainSequence([1, 2], [3], token_values={"labels": [0.0]})
    with pytest.raises(ValueError, match="reserved"):
        to_tensors([reserved], length=2, pad_id=0)


# ---------------------------------------------------------------- config
def _config(**parallel):
    return {
        "model": {"hf_config": tiny_hf_config("moe")},
        "parallel": parallel,
        "rollout": {"max_new_tokens": 64},
    }


def test_config_accepts_a_budget_and_drops_the_even_split_rule():
    cfg = config_from_dict({**_config(micro_batches=3, max_tokens_per_micro_batch=256)})
    assert cfg.parallel.max_tokens_per_micro_batch == 256
    with pytest.raises(ConfigError, match="not divisible"):  # padded micro-batches still need an even split
        config_from_dict(_config(micro_batches=3))


def test_config_refuses_a_budget_below_the_longest_response():
    with pytest.raises(
        ConfigError, match=r"max_tokens_per_micro_batch=32 is smaller than rollout\.max_new_tokens=64"
    ):
        config_from_dict(_config(max_tokens_per_micro_batch=32))
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        config_from_dict(_config(max_tokens_per_micro_batch=0))


def test_the_trainer_packs_when_the_budget_is_set():
    """``parallel.max_tokens_per_micro_batch`` reaches the trainer's micro-batches (and null keeps them padded)."""
    from types import SimpleNamespace

    from sapo_megatron.loop.trainer import _micro_batches

    seqs = [TrainSequence([1, 2, 3], [4] * n) for n in (3, 9, 5, 2)]
    for budget, packed in ((None, False), (96, True)):
        cfg = config_from_dict(_config(tp=1, micro_batches=2, max_tokens_per_micro_batch=budget))
        session = SimpleNamespace(
            cfg=cfg, info=SimpleNamespace(dp_rank=0, dp_size=1), tokenizer=SimpleNamespace(pad_id=0)
        )
        micro = _micro_batches(session, seqs)
        assert all((SEGMENT_IDS in mb) == packed for mb in micro)
        assert {mb["input_ids"].shape[0] for mb in micro} == ({1} if packed else {2})


def test_padding_fraction_counts_the_positions_without_a_token():
    seqs = [TrainSequence([1, 2], [3] * n) for n in (2, 9, 3, 6)]  # 3, 10, 4 and 7 model positions: 24
    padded = build_micro_batches(seqs, dp_rank=0, dp_size=1, micro_batches=2, pad_id=0)
    assert padding_fraction(seqs, StepBatch([padded]), dp_size=1) == pytest.approx(
        1 - 24 / 40
    )  # 2 × 2 rows of 10
    # budget 14: least-loaded onto 2 micro-batches gives 10 + 3 | 7 + 4, so 2 rows of T = 13
    packed = build_micro_batches(
        seqs, dp_rank=0, dp_size=1, micro_batches=1, pad_id=0, max_tokens_per_micro_batch=14
    )
    assert [mb["sequence_index"].tolist() for mb in packed] == [[0, 1], [2, 3]]
    assert padding_fraction(seqs, StepBatch([packed]), dp_size=1) == pytest.approx(1 - 24 / 26)
    # per update, every rank's micro-batches count (they all have the same shapes)
    assert padding_fraction(seqs * 2, StepBatch([packed]), dp_size=2) == pytest.approx(1 - 48 / 52)


def test_config_refuses_a_budget_below_an_episode():
    episode = {
        **_config(max_tokens_per_micro_batch=256),
        # a model whose context holds the episode (a context below it is refused on its own, tests/rollout)
        "model": {"hf_config": tiny_hf_config("moe", max_position_embeddings=2048)},
        "rollout": {"max_new_tokens": 64, "multi_turn": {"max_context_tokens": 1024}},
        "data": {"tokenizer": "/models/qwen3", "apply_chat_template": True},
    }
    with pytest.raises(
        ConfigError, match=r"smaller than an episode of rollout\.multi_turn\.max_context_tokens=1024"
    ):
        config_from_dict(episode)
    episode["parallel"]["max_tokens_per_micro_batch"] = 1024
    assert config_from_dict(episode).rollout.multi_turn.max_context_tokens == 1024
