"""Validation of the rollout data types and the wire helpers."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from sapo_megatron.rollout.base import RolloutError
from sapo_megatron.rollout.protocol import decode_routed_experts, encode_routed_experts, generate_payload
from sapo_megatron.rollout.types import GenerationRequest, Sample, SamplingParams


def test_sampling_params_validation():
    assert SamplingParams(temperature=0.0, max_new_tokens=1).is_greedy
    assert SamplingParams(top_k=1, max_new_tokens=1).is_greedy
    assert SamplingParams(max_new_tokens=1, seed=5).seed_for(2) == 7
    assert SamplingParams(max_new_tokens=1, stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    for bad in (
        {"temperature": -1},
        {"top_p": 0.0},
        {"top_k": 0},
        {"max_new_tokens": -1},
        {"stop_token_ids": (-2,)},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**({"max_new_tokens": 4} | bad))


def test_request_and_sample_validation():
    sampling = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        GenerationRequest(prompt_ids=[], n=1, sampling=sampling, group_id=3)
    with pytest.raises(ValueError, match="n must be >= 1"):
        GenerationRequest(prompt_ids=[1], n=0, sampling=sampling, group_id=3)
    ok = {
        "group_id": 1,
        "sample_index": 0,
        "prompt_ids": [1, 2],
        "response_ids": [3],
        "finish_reason": "stop",
    }
    with pytest.raises(ValueError, match="2 rollout_logp for 1 response tokens"):
        Sample(**ok, rollout_logp=[0.0, 0.0])
    with pytest.raises(ValueError, match=r"int32 \[2, num_layers, top_k\]"):
        Sample(**ok, rollout_logp=[0.0], routed_experts=np.zeros((3, 1, 1), np.int32))
    with pytest.raises(ValueError, match="finish_reason"):
        Sample(**(ok | {"finish_reason": "eos"}), rollout_logp=[0.0])
    assert Sample(**ok, rollout_logp=[-1.0]).token_ids == [1, 2, 3]


def test_rollout_error_names_server_request_and_field():
    err = RolloutError("bad reply", server="http://h:1", request="r-1", field="meta_info.x")
    assert str(err) == "bad reply [server=http://h:1, request=r-1, field=meta_info.x]"
    assert (err.server, err.request, err.field) == ("http://h:1", "r-1", "meta_info.x")
    assert str(RolloutError("plain")) == "plain"


def test_routed_experts_wire_format():
    routed = np.arange(5 * 2 * 3, dtype=np.int32).reshape(5, 2, 3)
    payload = encode_routed_experts(routed)
    assert base64.b64decode(payload) == routed.astype("<i4").tobytes()  # little-endian int32, C order
    np.testing.assert_array_equal(
        decode_routed_experts(payload, num_rows=5, num_layers=2, top_k=None), routed
    )
    with pytest.raises(RolloutError, match="num_layers"):
        decode_routed_experts(payload, num_rows=5, num_layers=None, top_k=None)
    with pytest.raises(RolloutError, match="do not divide"):
        decode_routed_experts(payload, num_rows=4, num_layers=2, top_k=None)


def test_generate_payload_fields():
    sampling = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=5, stop_token_ids=(2,), seed=10
    )
    payload = generate_payload([1, 2], sampling, rid="r", sample_index=3, return_routed_experts=True)
    assert payload == {
        "input_ids": [1, 2],
        "sampling_params": {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "max_new_tokens": 5,
            "stop_token_ids": [2],
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "sampling_seed": 13,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": "r",
        "return_routed_experts": True,
    }
    later = generate_payload([1, 2], sampling, rid="r", return_routed_experts=True, routed_experts_start=1)
    assert later["routed_experts_start_len"] == 1  # SGLang's name; only sent when not 0
    assert "routed_experts_start_len" not in generate_payload(
        [1, 2], sampling, rid="r", routed_experts_start=1
    )


def test_routes_start_within_the_prompt_and_set_the_rows_a_sample_holds():
    sampling = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match=r"routed_experts_start 4 is not in \[0, 3\]"):
        GenerationRequest(prompt_ids=[1, 2, 3], n=1, sampling=sampling, group_id=0, routed_experts_start=4)
    routes = np.zeros((5 - 1 - 2, 1, 2), dtype=np.int32)  # prompt 3 + response 2, rows from position 2
    sample = Sample(
        group_id=0, sample_index=0, prompt_ids=[1, 2, 3], response_ids=[4, 5], rollout_logp=[0.0, 0.0],
        finish_reason="stop", routed_experts=routes, routed_experts_start=2,
    )  # fmt: skip
    assert sample.routed_experts.shape[0] == 2
    with pytest.raises(ValueError, match=r"routed_experts must be int32 \[4,"):
        Sample(
            group_id=0, sample_index=0, prompt_ids=[1, 2, 3], response_ids=[4, 5], rollout_logp=[0.0, 0.0],
            finish_reason="stop", routed_experts=routes,
        )  # fmt: skip
