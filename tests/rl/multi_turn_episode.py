"""A user episode function for the loop test: two engine turns around a fixed observation, whatever the model
writes (a random tiny model never calls a tool), so every sample has a loss mask of two spans."""

from __future__ import annotations

from sapo_megatron.rollout.types import EpisodeInfo


async def two_turns(ctx, ledger) -> EpisodeInfo:
    for turn in range(2):
        sample = await ctx.generate(list(ledger.tokens), ctx.limits.max_new_tokens)
        ledger.add_turn(sample)
        if sample.finish_reason == "abort":
            return EpisodeInfo(status="aborted", turns=ledger.turns)
        if turn == 0:
            ledger.add_observation(ctx.deltas.ids([{"role": "tool", "content": "42"}]))
    return EpisodeInfo(status="completed", turns=ledger.turns, tool_calls=1)
