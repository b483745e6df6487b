"""The in-process CPU engine against plain transformers forwards of the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sapo_megatron.rollout.cpu.engine import CPUEngine
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams
from tests.rollout.conftest import (
    NUM_LAYERS,
    TOP_K,
    engine_from,
    load,
    make_moe_model,
    reference_logprobs,
    reference_routing,
)

# fp32 on CPU: left padding and the KV cache change the sums' order only, so differences stay near 1e-6.
LOGP_ATOL = 1e-4

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12]]


def requests(sampling: SamplingParams, n: int = 3, routed: bool = False) -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt_ids=p, n=n, sampling=sampling, return_routed_experts=routed, group_id=10 + i)
        for i, p in enumerate(PROMPTS)
    ]


@pytest.fixture(scope="module")
def engine(moe_dir):
    return engine_from(moe_dir, seed=0)


@pytest.fixture(scope="module")
def reference(moe_dir):
    return load(moe_dir)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_plain_forward(engine, reference, temperature):
    sampling = SamplingParams(temperature=temperature, max_new_tokens=8)
    groups = engine.generate(requests(sampling))
    assert [g[0].group_id for g in groups] == [10, 11, 12]
    for group in groups:
        assert [s.sample_index for s in group] == [0, 1, 2]
        for s in group:
            assert len(s.response_ids) == 8 and s.finish_reason == "length"
            # SGLang's convention: log_softmax(logits / T) of the sampled token, no top-k/top-p renormalisation.
            expected = reference_logprobs(reference, s.token_ids, len(s.prompt_ids), temperature)
            np.testing.assert_allclose(s.rollout_logp, expected, atol=LOGP_ATOL)


def test_return_original_logprob_reports_temperature_one(moe_dir, reference):
    engine = engine_from(moe_dir, return_original_logprob=True)
    sample = engine.generate(requests(SamplingParams(temperature=0.5, max_new_tokens=6), n=1))[0][0]
    expected = reference_logprobs(reference, sample.token_ids, len(sample.prompt_ids), 1.0)
    np.testing.assert_allclose(sample.rollout_logp, expected, atol=LOGP_ATOL)


def test_routed_experts_match_the_routers_of_a_plain_forward(engine, reference):
    sampling = SamplingParams(max_new_tokens=7, stop_token_ids=(3, 5))
    for group in engine.generate(requests(sampling, routed=True)):
        for s in group:
            routed = s.routed_experts
            assert routed.dtype == np.int32
            assert routed.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, NUM_LAYERS, TOP_K)
            np.testing.assert_array_equal(np.sort(routed, axis=-1), reference_routing(reference, s.token_ids))


def test_stop_tokens_and_length(engine):
    sampling = SamplingParams(max_new_tokens=12, stop_token_ids=tuple(range(0, 64, 2)))
    for group in engine.generate(requests(sampling, n=4)):
        for s in group:
            if s.finish_reason == "stop":
                assert s.response_ids[-1] % 2 == 0 and all(t % 2 for t in s.response_ids[:-1])
            else:
                assert len(s.response_ids) == 12 and all(t % 2 for t in s.response_ids)
    zero = engine.generate(requests(SamplingParams(max_new_tokens=0), n=1, routed=True))
    assert zero[0][0].response_ids == [] and zero[0][0].routed_experts.shape[0] == len(PROMPTS[0]) - 1


def test_a_stop_token_on_the_last_allowed_token_is_a_stop(engine):
    """SGLang 0.5.23 (``Req.update_finish_state``) checks stop tokens before the length cap: a stop sampled as the
    last allowed token finishes "stop", not "length" (tests/sglang_real/test_conformance.py checks the real server)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    [[free]] = engine.generate(requests(greedy, n=1)[:1])
    k = next(i for i, t in enumerate(free.response_ids) if i and t not in free.response_ids[:i])
    capped = SamplingParams(temperature=0.0, max_new_tokens=k + 1, stop_token_ids=(free.response_ids[k],))
    [[at_cap]] = engine.generate(requests(capped, n=1)[:1])
    assert (at_cap.response_ids, at_cap.finish_reason) == (free.response_ids[: k + 1], "stop")


def test_greedy_top_k_and_top_p_follow_the_distribution(engine, reference):
    greedy = engine.generate(requests(SamplingParams(temperature=0.0, max_new_tokens=5), n=2))
    for group in greedy:
        assert group[0].response_ids == group[1].response_ids
        ids = torch.tensor([group[0].token_ids])
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[0]
        start = len(group[0].prompt_ids)
        assert group[0].response_ids == logits[start - 1 : -1].argmax(-1).tolist()
    # top_k=2: every sampled token is one of the two most likely; top_p tiny: always the most likely.
    for sampling, allowed in (
        (SamplingParams(top_k=2, max_new_tokens=5), 2),
        (SamplingParams(top_p=1e-6, max_new_tokens=5), 1),
    ):
        for group in engine.generate(requests(sampling, n=3)):
            for s in group:
                with torch.no_grad():
                    logits = reference(input_ids=torch.tensor([s.token_ids])).logits[0]
                start = len(s.prompt_ids)
                ranks = logits[start - 1 : -1].argsort(-1, descending=True)[:, :allowed]
                assert all(t in r.tolist() for t, r in zip(s.response_ids, ranks))


def test_seeded_samples_do_not_depend_on_batching(engine):
    sampling = SamplingParams(max_new_tokens=6, seed=1234)
    together = engine.generate(requests(sampling, n=3))
    alone = engine.generate([requests(sampling, n=3)[1]])
    assert [s.response_ids for s in alone[0]] == [s.response_ids for s in together[1]]
    assert len({tuple(s.response_ids) for s in together[1]}) > 1  # seed + index differs per sample
    fresh = CPUEngine(engine.model, seed=0, num_threads=1).generate(
        requests(SamplingParams(max_new_tokens=6), n=2)
    )
    again = CPUEngine(engine.model, seed=0, num_threads=1).generate(
        requests(SamplingParams(max_new_tokens=6), n=2)
    )
    assert [[s.response_ids for s in g] for g in fresh] == [[s.response_ids for s in g] for g in again]


def test_score_matches_a_plain_forward(engine, reference):
    seqs = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    scored = engine.score(seqs, [3, 1])
    np.testing.assert_allclose(scored[0], reference_logprobs(reference, seqs[0], 3), atol=LOGP_ATOL)
    np.testing.assert_allclose(scored[1], reference_logprobs(reference, seqs[1], 1), atol=LOGP_ATOL)
    with pytest.raises(ValueError, match="response_start"):
        engine.score(seqs, 0)


def test_update_weights_from_tensors_takes_checkpoint_names(moe_dir, moe_dir_b):
    engine = engine_from(moe_dir)
    target = make_moe_model(1)  # the weights saved in moe_dir_b
    from safetensors.torch import load_file

    checkpoint = load_file(str(moe_dir_b / "model.safetensors"))  # per-expert names, as on disk
    assert any(".mlp.experts.0.gate_proj.weight" in name for name in checkpoint)
    engine.update_weights_from_tensors(checkpoint.items())
    for name, param in target.state_dict().items():
        torch.testing.assert_close(engine.model.state_dict()[name], param, rtol=0, atol=0, msg=name)
    assert engine.weight_version == 1

    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(ValueError, match="unknown weight name"):
        engine.update_weights_from_tensors(
            [("model.embed_tokens.weight", torch.zeros(64, 32)), ("nope.weight", torch.zeros(1))]
        )
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights_from_tensors(
            [("model.layers.0.mlp.experts.1.up_proj.weight", torch.zeros(3, 3))]
        )
    for name, value in engine.model.state_dict().items():  # nothing was copied by the failed calls
        assert torch.equal(value, before[name]), name


def test_update_weights_from_disk_and_rejects_other_shapes(moe_dir, moe_dir_b, dense_dir):
    engine = engine_from(moe_dir)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(requests(sampling, n=1))
    engine.update_weights_from_disk(str(moe_dir_b))
    after = engine.generate(requests(sampling, n=1))
    assert [g[0].rollout_logp for g in before] != [g[0].rollout_logp for g in after]
    with pytest.raises(ValueError, match="not the served model's architecture: 6 tensors missing"):
        engine.update_weights_from_disk(str(dense_dir))


def test_dense_model_generates_but_has_no_routing(dense_dir):
    engine = engine_from(dense_dir)
    assert not engine.is_moe
    sample = engine.generate(requests(SamplingParams(max_new_tokens=4), n=1))[0][0]
    np.testing.assert_allclose(
        sample.rollout_logp,
        reference_logprobs(load(dense_dir), sample.token_ids, len(sample.prompt_ids)),
        atol=LOGP_ATOL,
    )
    with pytest.raises(ValueError, match="MoE"):
        engine.generate(requests(SamplingParams(max_new_tokens=4), n=1, routed=True))
    with pytest.raises(ValueError, match="outside"):
        engine.generate(
            [
                GenerationRequest(
                    prompt_ids=[1, 99], n=1, sampling=SamplingParams(max_new_tokens=1), group_id=0
                )
            ]
        )
