"""Multi-turn episodes against the real SGLang server on CPU (the tier's one server, see conftest.py): ids in and
out over three turns with observations between them, the routes spliced across turns equal the reference
router's for every token (observations and each turn's last sampled token included), the served log-probs equal
the reference forward's on the mask-1 tokens; and Qwen3 tool calls parse as SGLang's own ``qwen25`` detector
parses them (``POST /parse_function_call``)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from sapo_megatron.rollout.episodes import EpisodeEngine, EpisodeLimits, ToolSet, parse_tool_calls
from sapo_megatron.rollout.types import EpisodeInfo, GenerationRequest, SamplingParams
from tests.sglang_real.conftest import API_KEY, TOP_K
from tests.sglang_real.test_conformance import FP32_TOL, reference_logp

PROMPTS = [[1, 10, 11, 12, 13], [1, 20, 21, 22, 23, 24, 25]]
OBSERVATION = [5, 6, 7, 8]
TURN_TOKENS = 6


async def three_turns(ctx, ledger) -> EpisodeInfo:
    """Three engine turns with observations of 2 and 3 tokens between them (whatever the random model writes)."""
    for turn in range(3):
        sample = await ctx.generate(list(ledger.tokens), TURN_TOKENS)
        ledger.add_turn(sample)
        if sample.finish_reason != "length" or turn == 2:
            return EpisodeInfo(status="completed", turns=ledger.turns)
        ledger.add_observation(OBSERVATION[: 2 + turn])
    raise AssertionError("unreachable")


def reference_routes(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """Sorted router top-k of one plain forward over ``ids[:-1]``: ``[len - 1, layers, k]``."""
    with torch.no_grad():
        out = model(torch.tensor([ids[:-1]]), output_router_logits=True)
    layers = [logits.reshape(len(ids) - 1, -1).topk(TOP_K, dim=-1).indices for logits in out.router_logits]
    return np.sort(torch.stack(layers, dim=1).numpy(), axis=-1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_episodes_splice_routes_and_keep_log_probs_across_turns(client, reference, temperature):
    limits = EpisodeLimits(max_turns=3, max_tool_calls=0, max_context_tokens=64, max_new_tokens=TURN_TOKENS)
    tools = ToolSet([], timeout_s=1, max_concurrent=1, max_output_chars=10)
    episodes = EpisodeEngine(
        client,
        three_turns,
        tools=tools,
        deltas=None,
        limits=limits,
        decode=str,
        parallel_calls=8,
        user_function=True,
    )
    sampling = SamplingParams(temperature=temperature, max_new_tokens=TURN_TOKENS, seed=7)
    requests = [
        GenerationRequest(prompt_ids=p, n=2, sampling=sampling, return_routed_experts=True, group_id=g)
        for g, p in enumerate(PROMPTS)
    ]
    groups = episodes.generate(requests)
    multi_turn, deltas = 0, []
    for group in groups:
        for s in group:
            ids = s.token_ids
            assert s.routed_experts.shape[0] == len(ids) - 1
            np.testing.assert_array_equal(
                np.sort(s.routed_experts, axis=-1), reference_routes(reference, ids)
            )
            mask = np.array(s.loss_mask, dtype=bool)
            expected = reference_logp(reference, ids)[len(s.prompt_ids) - 1 :].numpy()
            np.testing.assert_allclose(np.array(s.rollout_logp)[mask], expected[mask], atol=FP32_TOL)
            deltas += np.abs(np.array(s.rollout_logp)[mask] - expected[mask]).tolist()
            assert (np.array(s.rollout_logp)[~mask] == 0).all()
            multi_turn += s.episode.turns > 1
    assert multi_turn >= 2  # the random model rarely stops within 6 tokens: most episodes have 3 turns
    print(
        f"engine/reference |Δ log p| on {len(deltas)} mask-1 tokens: max {max(deltas):.2e}, mean {np.mean(deltas):.2e}"
    )


TOOLS = [
    {"type": "function", "function": {"name": "python", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}},
]
TEXTS = [
    "Let me run it.\n<tool_call>\n"
    + json.dumps({"name": "python", "arguments": {"code": "print(6 * 7)"}})
    + "\n</tool_call>",
    'Two calls.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "python", "parameters": {"code": "x = 1"}}\n</tool_call>',
    "No tool this time, the answer is 42.",
    '  Broken first.\n<tool_call>\n{not json}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {}}\n'
    "</tool_call>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tool_calls_parse_as_sglang_qwen25_parses_them(sglang_url, text):
    reply = httpx.post(
        f"{sglang_url}/parse_function_call",
        json={"text": text, "tool_call_parser": "qwen25", "tools": TOOLS},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    served = reply.json()
    normal, calls = parse_tool_calls(text)
    assert normal == served["normal_text"]
    ours = [(c.name, c.arguments) for c in calls if c.error is None]  # SGLang drops the blocks we flag
    assert ours == [(c["name"], json.loads(c["parameters"])) for c in served["calls"]]
