"""Partial rollouts: a sample cut short by an ``abort`` pause is continued after the weight update, never restarted.

The continuation feeds prompt + partial response as its prompt and asks for the routes from the partial's last
token on (that token is fed by the continuation, whose forward produces the next log-prob). Splicing keeps each
token's log-prob, version and route from the forward that produced it: the partial's rows ``< P + k - 1`` (old
version), the continuation's from ``P + k - 1`` on (new version), where ``P`` is the prompt and ``k`` the partial
length.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from sapo_megatron.rollout.types import GenerationRequest, Sample

# SGLang 0.5.23 ``PauseGenerationReqInput.mode`` (srt/managers/io_struct.py); see rollout/cpu/pause.py
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")


def already_ended(request: GenerationRequest, partial: Sample) -> Sample | None:
    """``partial`` as a finished sample when the abort cut nothing: it already holds its whole token budget
    (``length``) or ends with one of the request's stop tokens (``stop``) – an abort that reached the server after
    the last token was sampled but before the request was reported finished. Continuing it would add tokens past
    the budget or after the stop. None: it is to be continued."""
    if partial.response_ids and partial.response_ids[-1] in request.sampling.stop_token_ids:
        return dataclasses.replace(partial, finish_reason="stop")  # first, as SGLang 0.5.23 decides
    if partial.response_ids and len(partial.response_ids) >= request.sampling.max_new_tokens:
        return dataclasses.replace(partial, finish_reason="length")
    return None


def continuation_request(request: GenerationRequest, partial: Sample) -> GenerationRequest:
    """One more sample of ``request`` that carries ``partial`` on (its remaining token budget)."""
    if partial.finish_reason != "abort":
        raise ValueError(
            f"group {partial.group_id}: only an aborted sample is continued, not a {partial.finish_reason!r} one"
        )
    prefix = [*partial.prompt_ids, *partial.response_ids]
    remaining = request.sampling.max_new_tokens - len(partial.response_ids)
    seed = request.sampling.seed_for(partial.sample_index)
    sampling = dataclasses.replace(
        request.sampling,
        max_new_tokens=remaining,
        seed=None
        if seed is None
        else seed + len(partial.response_ids),  # not the partial's random stream again
    )
    return GenerationRequest(
        prompt_ids=prefix,
        n=1,
        sampling=sampling,
        return_routed_experts=request.return_routed_experts,
        group_id=request.group_id,
        # nothing made yet: the request itself; else the partial's last token on (its feed makes the next log-prob)
        routed_experts_start=len(prefix) - 1 if partial.response_ids else request.routed_experts_start,
        images=request.images,
    )


def splice(
    partial: Sample, continuation: Sample, *, partial_version: int, continuation_version: int
) -> Sample:
    """``partial`` followed by ``continuation``: one sample whose tokens carry the version of their forward."""
    versions = list(partial.token_versions or [partial_version] * len(partial.response_ids))
    versions += continuation.token_versions or [continuation_version] * len(continuation.response_ids)
    routed = continuation.routed_experts if not partial.response_ids else None
    if (
        partial.response_ids
        and partial.routed_experts is not None
        and continuation.routed_experts is not None
    ):
        keep = len(partial.prompt_ids) + len(partial.response_ids) - 1 - partial.routed_experts_start
        routed = np.concatenate([partial.routed_experts[:keep], continuation.routed_experts], axis=0)
    return dataclasses.replace(
        partial,
        response_ids=[*partial.response_ids, *continuation.response_ids],
        rollout_logp=[*partial.rollout_logp, *continuation.rollout_logp],
        finish_reason=continuation.finish_reason,
        routed_experts=routed,
        token_versions=versions,
    )
