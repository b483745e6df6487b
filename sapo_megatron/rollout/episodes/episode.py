"""One multi-turn episode on one token sequence: the ledger that keeps it exact, and the built-in tool loop.

Ids in, ids out: every turn is generated from the episode's accumulated ids, the engine's output ids are
appended as they are (loss mask 1, the engine's log-probs), tool observations are appended as template deltas
(mask 0, log-prob 0). :class:`EpisodeLedger` checks that each turn's input *is* the sequence so far – a turn built
from re-tokenized text would drift from the ids the policy sampled (AReaL asserts the same; sglang PR #26555 shows
drift breaking routing replay) – and stops the run naming the sample, turn and first differing position.

Routes (R3): the rows of earlier tokens were already reported by the turns that decoded them and are kept; a turn
contributes the rows from where the previous one stopped: the previous turn's last sampled token (which it never
fed), the observation, its own tokens. So every row comes from the forward that computed the log-probs trained on
(NeMo-RL PR #3485). A turn asks for only those rows (``routed_experts_start``, SGLang's
``routed_experts_start_len``): the payload stays one episode's routes in all, not one per turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sapo_megatron.errors import UserError
from sapo_megatron.rollout.episodes.template import ObservationDeltas
from sapo_megatron.rollout.episodes.tool_calls import parse_tool_calls
from sapo_megatron.rollout.episodes.tools import ToolSet
from sapo_megatron.rollout.types import EpisodeInfo, EpisodeStatus, FinishReason, Sample

_FINISH: dict[str, FinishReason] = {
    "completed": "stop",
    "truncated": "length",
    "aborted": "abort",
    "failed": "abort",  # never trained, like an aborted sample (its group is replaced)
}


class EpisodeDriftError(UserError):
    """A turn's input is not the episode's token sequence so far (re-tokenization drift)."""


@dataclass(frozen=True)
class EpisodeLimits:
    """``max_turns`` engine turns, ``max_tool_calls`` calls, ``max_context_tokens`` tokens in all (prompt,
    turns, observations; each turn's ``max_new_tokens`` is clamped to what is left), at most ``max_new_tokens``
    per turn. Reaching one ends the episode as truncated (``EpisodeInfo.truncated_by`` says which)."""

    max_turns: int
    max_tool_calls: int
    max_context_tokens: int
    max_new_tokens: int


class EpisodeLedger:
    """The episode's tokens as they grow, with the per-response-token mask, log-probs and the spliced routes."""

    def __init__(self, prompt_ids: Sequence[int], name: str) -> None:
        self.name = name
        self.prompt_ids = list(prompt_ids)
        self.tokens = list(prompt_ids)
        self.loss_mask: list[int] = []
        self.rollout_logp: list[float] = []
        self.routes: np.ndarray | None = None
        self.turns = 0
        self._routes_missing = False
        # each response token's engine version (None: an observation, or a turn whose engine reported none)
        self.versions: list[int | None] = []
        self._versions_missing = False

    def check_input(self, input_ids: Sequence[int]) -> None:
        """Raise :class:`EpisodeDriftError` unless ``input_ids`` equals the sequence so far."""
        ids = list(input_ids)
        if ids == self.tokens:
            return
        at = next(
            (i for i, (a, b) in enumerate(zip(ids, self.tokens)) if a != b), min(len(ids), len(self.tokens))
        )
        raise EpisodeDriftError(
            f"{self.name}, turn {self.turns + 1}: the turn's input ({len(ids)} tokens) is not the episode's "
            f"{len(self.tokens)} tokens so far; first difference at position {at} "
            f"(input {ids[at : at + 4]}, episode {self.tokens[at : at + 4]})",
            hint="send the episode's token ids to the engine; never re-tokenize decoded text",
        )

    def add_turn(self, turn: Sample) -> None:
        """Append an engine turn generated from the sequence so far (its ``prompt_ids``)."""
        self.check_input(turn.prompt_ids)
        self.tokens += turn.response_ids
        self.loss_mask += [1] * len(turn.response_ids)
        self.rollout_logp += list(turn.rollout_logp)
        self.turns += 1
        self._versions_missing |= turn.token_versions is None
        self.versions += turn.token_versions or [None] * len(turn.response_ids)
        if turn.routed_experts is None:
            self._routes_missing = True
            return
        rows, start = (
            turn.routed_experts,
            turn.routed_experts_start,
        )  # rows of positions start, start + 1, ...
        known = 0 if self.routes is None else len(self.routes)
        if rows.shape[0] != len(self.tokens) - 1 - start or start > known:
            raise EpisodeDriftError(
                f"{self.name}, turn {self.turns}: the engine reported routes for {rows.shape[0]} tokens from "
                f"position {start}; the sequence has {len(self.tokens)} and routes are known up to {known}"
            )
        new = rows[known - start :]
        self.routes = new.copy() if self.routes is None else np.concatenate([self.routes, new])

    def add_observation(self, ids: Sequence[int]) -> None:
        """Append tokens the policy did not sample (mask 0, log-prob 0)."""
        self.tokens += list(ids)
        self.loss_mask += [0] * len(ids)
        self.rollout_logp += [0.0] * len(ids)
        self.versions += [None] * len(ids)

    def token_versions(self) -> list[int] | None:
        """Each response token's engine version – a turn's tokens their own (an episode spans weight updates), an
        observation the version of the turn before it (the first turn's when it comes first; untrained either
        way) – or None when a turn came without versions."""
        known = [v for v in self.versions if v is not None]
        if self._versions_missing or not known:
            return None
        out, last = [], known[0]
        for v in self.versions:
            last = last if v is None else v
            out.append(last)
        return out

    @property
    def response_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    def sample(self, group_id: int, sample_index: int, info: EpisodeInfo) -> Sample:
        routes = None if self._routes_missing or self.routes is None else self.routes
        if routes is not None and len(routes) != len(self.tokens) - 1:  # ended on an observation: never
            raise AssertionError(f"{self.name}: {len(routes)} route rows for {len(self.tokens)} tokens")
        return Sample(
            group_id=group_id,
            sample_index=sample_index,
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            rollout_logp=self.rollout_logp,
            finish_reason=_FINISH[info.status],
            routed_experts=routes,
            loss_mask=self.loss_mask,
            episode=info,
            token_versions=self.token_versions(),
        )


GenerateTurn = Callable[[list[int], int], Awaitable[Sample]]
"""``generate(ids, max_new_tokens)``: one engine turn from ``ids`` (one sample, the episode's sampling)."""


@dataclass
class EpisodeContext:
    """What an episode function gets: the engine turn, the tools, the template deltas, the limits and a decoder.
    A user episode function (``rollout.multi_turn.episode_function``) receives it too."""

    generate: GenerateTurn
    tools: ToolSet
    deltas: ObservationDeltas | None  # None: the episode function appends its own observation ids
    limits: EpisodeLimits
    decode: Callable[[list[int]], str]


EpisodeFn = Callable[[EpisodeContext, EpisodeLedger], Awaitable[EpisodeInfo]]
"""An episode function: it grows the ledger (``add_turn`` / ``add_observation``) and returns how it went."""


async def tool_episode(ctx: EpisodeContext, ledger: EpisodeLedger) -> EpisodeInfo:
    """The built-in loop (slime's retool generate, verl's ``ToolAgentLoop``): generate a turn; if it calls tools,
    run the calls concurrently, append their results as one delta, and generate again; stop when a turn calls
    no tool (completed), at a limit (truncated), or when the engine aborts."""
    limits, calls, errors = ctx.limits, 0, 0
    deltas = ctx.deltas
    if deltas is None:
        raise ValueError("tool_episode appends tool results as template deltas: its context needs ctx.deltas")

    def info(status: EpisodeStatus, truncated_by: str | None = None) -> EpisodeInfo:
        return EpisodeInfo(
            status=status, turns=ledger.turns, tool_calls=calls, tool_errors=errors, truncated_by=truncated_by
        )

    while True:
        left = limits.max_context_tokens - len(ledger.tokens)
        if left <= 0:
            return info("truncated", "max_context")
        turn = await ctx.generate(list(ledger.tokens), min(limits.max_new_tokens, left))
        ledger.add_turn(turn)
        if turn.finish_reason == "abort":
            return info("aborted")
        if turn.finish_reason == "length":
            return info("truncated", "length" if left > limits.max_new_tokens else "max_context")
        _, requested = parse_tool_calls(ctx.decode(turn.response_ids))
        if not requested:
            return info("completed")
        if ledger.turns >= limits.max_turns:
            return info("truncated", "max_turns")
        if calls + len(requested) > limits.max_tool_calls:
            return info("truncated", "max_tool_calls")
        outcomes = await asyncio.gather(*(ctx.tools.call(call) for call in requested))
        calls += len(requested)
        errors += sum(outcome.error for outcome in outcomes)
        delta = deltas.ids([{"role": "tool", "content": outcome.text} for outcome in outcomes])
        if len(ledger.tokens) + len(delta) >= limits.max_context_tokens:  # no room for the next turn
            return info("truncated", "max_context")
        ledger.add_observation(delta)
