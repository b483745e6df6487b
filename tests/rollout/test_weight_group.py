"""weight_group in one process: argument checks, a one-rank group's life cycle, the request metadata."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sapo_megatron.rollout.weight_group import (
    WeightGroupError,
    broadcast_bucket,
    destroy_custom_process_group,
    init_custom_process_group,
    parse_dtype,
    tensor_metadata,
)
from tests.ports import free_port


@pytest.mark.parametrize(
    ("backend", "world_size", "rank", "name", "words"),
    [
        ("mpi", 2, 0, "g", "backend 'mpi' is not supported"),
        ("gloo", 2, 2, "g", "rank 2 is outside world_size 2"),
        ("gloo", 2, 0, "", "group_name cannot be empty"),
    ],
)
def test_bad_arguments_are_refused_before_connecting(backend, world_size, rank, name, words):
    with pytest.raises(WeightGroupError, match=words):
        init_custom_process_group(backend, "127.0.0.1", 1, world_size, rank, name, timeout=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_nccl_without_cuda_is_refused_clearly():
    with pytest.raises(WeightGroupError, match=r"'nccl' needs CUDA.*use backend 'gloo'"):
        init_custom_process_group("nccl", "127.0.0.1", 1, 2, 0, "g", timeout=1)


def test_one_rank_group_life_cycle_leaves_the_default_group_alone():
    had_default_group = dist.is_initialized()
    port = free_port()
    group = init_custom_process_group("gloo", "127.0.0.1", port, 1, 0, "solo", timeout=10)
    try:
        with pytest.raises(WeightGroupError, match="'solo' already exists in this process"):
            init_custom_process_group("gloo", "127.0.0.1", free_port(), 1, 0, "solo", timeout=10)
        sent = [torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)]
        broadcast_bucket(group, sent, timeout_s=10)  # rank 0 of 1: completes, tensors unchanged
        assert torch.equal(sent[0], torch.arange(6.0).reshape(2, 3))
    finally:
        destroy_custom_process_group(group)
    assert dist.is_initialized() == had_default_group  # no default group created (or destroyed) on the way
    again = init_custom_process_group("gloo", "127.0.0.1", free_port(), 1, 0, "solo", timeout=10)
    destroy_custom_process_group(again)


def test_metadata_uses_sglangs_dtype_names():
    named = [("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(4))]
    assert tensor_metadata(named) == (["a", "b"], ["bfloat16", "float32"], [[2, 3], [4]])
    assert parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="'Tensor' is not a torch dtype name"):
        parse_dtype("Tensor")
