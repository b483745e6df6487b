"""Pause, weight update, continue (miles #3277): each response token's log-prob and route come from the forward of
the version that produced it, checked against teacher-forced reference forwards of each version's weights."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
import torch

from sapo_megatron.rollout.cpu.server import CPUServer
from sapo_megatron.rollout.partial import already_ended, continuation_request, splice
from sapo_megatron.rollout.types import GenerationRequest, Sample, SamplingParams
from tests.rollout.conftest import engine_from, load, reference_logprobs, reference_routing

PROMPT = [3, 17, 5, 42, 8, 11]
NEW_TOKENS = 12
PAUSE_AT = 5  # tokens sampled before the pause


@pytest.fixture(scope="module")
def refs(moe_dir, moe_dir_b):
    return {0: load(moe_dir), 1: load(moe_dir_b)}


def request(n: int = 2) -> GenerationRequest:
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=7)
    return GenerationRequest(
        prompt_ids=PROMPT, n=n, sampling=sampling, return_routed_experts=True, group_id=0
    )


def per_version_reference(refs, sample: Sample) -> tuple[np.ndarray, np.ndarray]:
    """Expected log-probs and routes: each token (and the route row that produced it) from a plain forward of its
    version's weights over the whole sequence (prompt rows: the first token's version)."""
    ids, p = sample.token_ids, len(sample.prompt_ids)
    versions = np.asarray(sample.token_versions)
    logp = {v: reference_logprobs(refs[v], ids, p) for v in set(versions.tolist())}
    routes = {v: reference_routing(refs[v], ids) for v in set(versions.tolist())}
    want_logp = np.array([logp[v][t] for t, v in enumerate(versions)])
    row_versions = np.concatenate([np.full(p - 1, versions[0]), versions])  # row p -> token p + 1
    want_routes = np.stack([routes[v][row] for row, v in enumerate(row_versions)])
    return want_logp, want_routes


def agreement(sample: Sample, want_routes: np.ndarray) -> float:
    return float((np.sort(sample.routed_experts, axis=-1) == want_routes).mean())


@pytest.mark.parametrize("mode", ["retract", "abort"])
def test_a_sample_paused_mid_response_pairs_each_token_with_its_versions_forward(
    mode, moe_dir, moe_dir_b, refs
):
    engine = engine_from(moe_dir)
    req = request()
    engine.pause_after(PAUSE_AT, mode, lambda: engine.update_weights_from_disk(str(moe_dir_b)))
    samples = engine.generate([req])[0]
    if mode == "abort":  # the partial comes back; the weights are updated; the sample is continued
        assert [s.finish_reason for s in samples] == ["abort", "abort"]
        assert [len(s.response_ids) for s in samples] == [PAUSE_AT, PAUSE_AT]
        engine.update_weights_from_disk(str(moe_dir_b))
        samples = [
            splice(
                s,
                engine.generate([continuation_request(req, s)])[0][0],
                partial_version=0,
                continuation_version=1,
            )
            for s in samples
        ]
    for s in samples:
        assert len(s.response_ids) == NEW_TOKENS
        assert s.token_versions == [0] * PAUSE_AT + [1] * (NEW_TOKENS - PAUSE_AT)
        want_logp, want_routes = per_version_reference(refs, s)
        np.testing.assert_allclose(s.rollout_logp, want_logp, atol=1e-4)
        assert agreement(s, want_routes) == 1.0
        # the bug of miles #3277: routes of the prefix from the new version's re-prefill do not pair
        stale = reference_routing(refs[1], s.token_ids)[: len(PROMPT) + PAUSE_AT - 1]
        assert (np.sort(s.routed_experts, axis=-1)[: len(PROMPT) + PAUSE_AT - 1] != stale).any()


@torch.no_grad()
def in_place_reference(refs, sample: Sample, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The old weights' cache of prompt + k - 1 tokens, then the new weights decoding on it (teacher-forced)."""
    from transformers import DynamicCache

    ids = torch.tensor([sample.token_ids])
    cut = len(sample.prompt_ids) + k - 1
    captured: dict[int, torch.Tensor] = {}
    model = refs[1]
    handles = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out, i=i: captured.__setitem__(i, out[2]))
        for i, layer in enumerate(model.model.layers)
    ]
    cache = DynamicCache()
    refs[0](input_ids=ids[:, :cut], past_key_values=cache, use_cache=True)
    try:
        logits = model(input_ids=ids[:, cut:], past_key_values=cache, use_cache=True).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, cut + 1 :, None]).squeeze(1).numpy()
    routes = np.stack([captured[i].numpy() for i in sorted(captured)], axis=1)[:-1]
    return logp, np.sort(routes, axis=-1)


def test_in_place_continues_on_the_old_cache_with_the_new_weights(moe_dir, moe_dir_b, refs):
    engine = engine_from(moe_dir)
    engine.pause_after(PAUSE_AT, "in_place", lambda: engine.update_weights_from_disk(str(moe_dir_b)))
    cut = len(PROMPT) + PAUSE_AT - 1
    for s in engine.generate([request()])[0]:
        assert s.token_versions == [0] * PAUSE_AT + [1] * (NEW_TOKENS - PAUSE_AT)
        before_logp, before_routes = per_version_reference(
            refs, Sample(**{**s.__dict__, "token_versions": [0] * NEW_TOKENS})
        )
        np.testing.assert_allclose(s.rollout_logp[:PAUSE_AT], before_logp[:PAUSE_AT], atol=1e-4)
        assert (np.sort(s.routed_experts[:cut], axis=-1) == before_routes[:cut]).mean() == 1.0
        after_logp, after_routes = in_place_reference(refs, s, PAUSE_AT)
        np.testing.assert_allclose(s.rollout_logp[PAUSE_AT:], after_logp, atol=1e-4)
        assert (np.sort(s.routed_experts[cut:], axis=-1) == after_routes).mean() == 1.0
        # and it is not the new version's own forward: the old cache shifts the tokens after the update
        fresh = reference_logprobs(refs[1], s.token_ids, len(PROMPT))[PAUSE_AT:]
        assert np.abs(np.asarray(s.rollout_logp[PAUSE_AT:]) - fresh).max() > 1e-3


# ---------------------------------------------------------------- the HTTP server
@pytest.fixture
def slow_server(moe_dir):
    """A server whose forwards take >= 20 ms, so that a pause lands mid-response."""
    engine = engine_from(moe_dir)
    engine.model.register_forward_pre_hook(lambda *_: time.sleep(0.02))
    with CPUServer(engine) as server:
        yield server


def _generate(url: str, out: dict, n_new: int = 40) -> None:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": n_new, "temperature": 1.0, "sampling_seed": 3},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    out["reply"] = httpx.post(f"{url}/generate", json=body, timeout=120).json()


def _sample(reply: dict) -> Sample:
    from sapo_megatron.rollout.protocol import decode_routed_experts

    meta = reply["meta_info"]
    ids = reply["output_ids"]
    routed = decode_routed_experts(
        meta["routed_experts"], num_rows=len(PROMPT) + len(ids) - 1, num_layers=2, top_k=2
    )
    return Sample(
        group_id=0,
        sample_index=0,
        prompt_ids=list(PROMPT),
        response_ids=ids,
        rollout_logp=[lp for lp, _tok, _ in meta["output_token_logprobs"]],
        finish_reason=meta["finish_reason"]["type"],
        routed_experts=routed,
        token_versions=[
            int(span["version"])
            for span in meta["weight_versions"]
            for _ in range(span["start"], span["end"])
        ],
    )


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_server_pause_update_continue(mode, slow_server, moe_dir_b, refs):
    url = slow_server.url
    out: dict = {}
    worker = threading.Thread(target=_generate, args=(url, out))
    worker.start()
    time.sleep(0.3)  # ~10 tokens in
    reply = httpx.post(f"{url}/pause_generation", json={"mode": mode}, timeout=30)
    assert reply.status_code == 200
    assert reply.json() == {"message": "Generation paused successfully.", "status": "ok"}
    update = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(moe_dir_b)}, timeout=60)
    assert update.status_code == 200 and update.json()["success"] is True
    assert httpx.post(f"{url}/continue_generation", json={}, timeout=30).json() == {
        "message": "Generation continued successfully.",
        "status": "ok",
    }
    worker.join(timeout=60)
    s = _sample(out["reply"])
    k = s.token_versions.count(0)
    assert 0 < k < 40 and s.token_versions == [0] * k + [1] * (len(s.response_ids) - k)
    if mode == "abort":
        assert s.finish_reason == "abort" and len(s.response_ids) == k
        return
    assert len(s.response_ids) == 40
    if mode == "retract":
        want_logp, want_routes = per_version_reference(refs, s)
        np.testing.assert_allclose(s.rollout_logp, want_logp, atol=1e-4)
        assert agreement(s, want_routes) == 1.0
    else:
        after_logp, _ = in_place_reference(refs, s, k)
        np.testing.assert_allclose(s.rollout_logp[k:], after_logp, atol=1e-4)


def test_server_pause_refuses_an_unknown_mode_and_requests_wait_while_paused(slow_server):
    url = slow_server.url
    bad = httpx.post(f"{url}/pause_generation", json={"mode": "freeze"}, timeout=10)
    assert bad.status_code == 400 and "abort" in bad.json()["message"]
    assert httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}, timeout=10).status_code == 200
    out: dict = {}
    worker = threading.Thread(target=_generate, args=(url, out, 3))
    worker.start()
    worker.join(timeout=1.0)
    assert worker.is_alive() and "reply" not in out  # held until continue
    httpx.post(f"{url}/continue_generation", json={}, timeout=10)
    worker.join(timeout=30)
    assert len(out["reply"]["output_ids"]) == 3
    assert out["reply"]["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 3}]


# ---------------------------------------------------------------- an abort after the last token


@pytest.mark.parametrize(
    ("response", "stop", "finish"),
    [
        ([7, 8, 9, 10], (), "length"),
        ([7, 8, 3], (3,), "stop"),
        ([7, 8, 9, 3], (3,), "stop"),  # a stop on the last allowed token: SGLang 0.5.23 says stop, not length
        ([7, 8, 9], (), None),
        ([], (), None),
    ],
)
def test_an_aborted_sample_that_already_ended_is_not_continued(response, stop, finish):
    """An abort that reaches the server after a sample's last token (its whole budget, or a stop token) returns a
    sample with nothing left to make: it is reported finished, never continued past its budget or its stop."""
    request = GenerationRequest(
        prompt_ids=[1, 2], n=1, group_id=0, sampling=SamplingParams(max_new_tokens=4, stop_token_ids=stop)
    )
    partial = Sample(
        group_id=0,
        sample_index=0,
        prompt_ids=[1, 2],
        response_ids=response,
        rollout_logp=[-0.5] * len(response),
        finish_reason="abort",
        token_versions=[0] * len(response),
    )
    ended = already_ended(request, partial)
    if finish is None:
        assert ended is None
        assert continuation_request(request, partial).sampling.max_new_tokens == 4 - len(response)
    else:
        assert ended is not None
        assert (ended.finish_reason, ended.response_ids, ended.token_versions) == (
            finish,
            response,
            [0] * len(response),
        )
