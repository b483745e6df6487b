"""Episodes on the CPU engine (a tiny Qwen3-MoE, turns of concurrent episodes batched into one forward): the
routes spliced across turns equal the routers of one plain forward over the whole episode for every token,
observation tokens included, and the engine's log-probs equal the plain forward's on every mask-1 token."""

from __future__ import annotations

import numpy as np
import pytest

from sapo_megatron.rollout.episodes import EpisodeEngine, EpisodeLimits, ToolSet
from sapo_megatron.rollout.types import EpisodeInfo, GenerationRequest, SamplingParams
from tests.rollout.conftest import engine_from, load, reference_logprobs, reference_routing

OBSERVATION = [7, 8, 9, 10]
PROMPTS = [[1, 2, 3, 4, 5, 6], [11, 12], [20, 21, 22, 23]]


async def three_turns(ctx, ledger) -> EpisodeInfo:
    for turn in range(3):
        sample = await ctx.generate(list(ledger.tokens), 5)
        ledger.add_turn(sample)
        if turn < 2:
            ledger.add_observation(OBSERVATION[: 2 + turn])
    return EpisodeInfo(status="completed", turns=3)


@pytest.fixture(scope="module")
def episodes(moe_dir):
    engine = engine_from(moe_dir, seed=0)
    limits = EpisodeLimits(max_turns=3, max_tool_calls=0, max_context_tokens=64, max_new_tokens=5)
    tools = ToolSet([], timeout_s=1, max_concurrent=1, max_output_chars=10)
    return EpisodeEngine(
        engine,
        three_turns,
        tools=tools,
        deltas=None,
        limits=limits,
        decode=str,
        parallel_calls=1,
        user_function=True,
    )


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_spliced_routes_and_log_probs_equal_one_forward_over_the_episode(episodes, moe_dir, temperature):
    reference = load(moe_dir)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=5, seed=3)
    requests = [
        GenerationRequest(prompt_ids=p, n=2, sampling=sampling, return_routed_experts=True, group_id=i)
        for i, p in enumerate(PROMPTS)
    ]
    calls = episodes.metrics()["episode/engine_calls"]
    groups = episodes.generate(requests)
    assert (
        episodes.metrics()["episode/engine_calls"] - calls == 3
    )  # 6 episodes × 3 turns in 3 batched forwards
    for group in groups:
        for s in group:
            assert s.episode.turns == 3 and sum(s.loss_mask) == 15
            assert len(s.response_ids) == 15 + 2 + 3
            np.testing.assert_array_equal(
                np.sort(s.routed_experts, axis=-1), reference_routing(reference, s.token_ids)
            )
            expected = reference_logprobs(reference, s.token_ids, len(s.prompt_ids))
            mask = np.array(s.loss_mask, dtype=bool)
            np.testing.assert_allclose(np.array(s.rollout_logp)[mask], expected[mask], atol=1e-4)
            assert (np.array(s.rollout_logp)[~mask] == 0).all()


def test_a_weight_update_pauses_the_episodes_turns_through_the_episode_engine(moe_dir, moe_dir_b):
    """Under fully_async the trainer pauses the rollout engine – for multi-turn runs the EpisodeEngine – and reads
    its weight version: both reach the wrapped engine. Turns asked for while paused wait for the new weights, so
    every turn after the first is version 1; the first turn's tokens are version 0 only up to the pause."""
    import threading

    engine = engine_from(moe_dir, seed=0)
    episodes = EpisodeEngine(
        engine,
        three_turns,
        tools=ToolSet([], timeout_s=1, max_concurrent=1, max_output_chars=10),
        deltas=None,
        limits=EpisodeLimits(max_turns=3, max_tool_calls=0, max_context_tokens=64, max_new_tokens=5),
        decode=str,
        parallel_calls=1,
        user_function=True,
    )
    before = episodes.served_weight_version()
    assert before == engine.served_weight_version()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    requests = [
        GenerationRequest(prompt_ids=p, n=2, sampling=sampling, group_id=i) for i, p in enumerate(PROMPTS)
    ]
    out: dict = {}
    episodes.pause_generation("in_place")
    worker = threading.Thread(target=lambda: out.update(groups=episodes.generate(requests)))
    worker.start()
    worker.join(timeout=1.0)
    assert worker.is_alive() and "groups" not in out  # held by the pause
    episodes.update_weights_from_disk(str(moe_dir_b))
    episodes.continue_generation()
    worker.join(timeout=60)
    assert episodes.served_weight_version() == before + 1
    for group in out["groups"]:
        for s in group:
            trained = [v for v, m in zip(s.token_versions, s.loss_mask) if m]
            assert len(trained) == 15 and set(trained) <= {before, before + 1}
            assert trained == sorted(trained) and trained[5:] == [before + 1] * 10, trained


def test_the_episode_engine_passes_every_engine_call_to_the_engine_it_wraps():
    """RolloutEngine's defaults (no pause, no weight version, no NCCL sync) are for engines without the feature; a
    wrapper that inherited one would hide the wrapped engine's (a pause under fully_async once did): EpisodeEngine
    defines every public call itself."""
    import inspect

    from sapo_megatron.rollout.base import RolloutEngine

    calls = {
        name for name, _ in inspect.getmembers(RolloutEngine, inspect.isfunction) if not name.startswith("_")
    }
    inherited = sorted(name for name in calls if name not in vars(EpisodeEngine))
    assert not inherited, inherited
