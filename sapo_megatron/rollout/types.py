"""Plain data passed between the trainer and a rollout engine.

A rollout engine turns :class:`GenerationRequest` objects (one prompt, ``n`` samples) into :class:`Sample` objects.
Nothing here knows about HTTP, SGLang or transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
EpisodeStatus = Literal["completed", "truncated", "aborted", "failed"]
EPISODE_STATUSES: tuple[str, ...] = ("completed", "truncated", "aborted", "failed")

# SGLang treats a temperature below this as greedy decoding (top_k = 1, logprobs of the raw logits).
SAMPLING_EPS = 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Sampling settings of one request, named as in SGLang's ``sampling_params``.

    ``top_k = -1`` means the whole vocabulary; ``temperature < 1e-6`` means greedy. ``seed``, when set, makes sample
    ``i`` of a request use the sampling seed ``seed + i`` (SGLang's ``sampling_seed``; SGLang honours it only when the
    server runs with deterministic inference enabled, the CPU engine always does).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"SamplingParams.top_k must be -1 (whole vocabulary) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        stop = tuple(int(t) for t in self.stop_token_ids)
        if any(t < 0 for t in stop):
            raise ValueError(f"SamplingParams.stop_token_ids must be non-negative token ids, got {stop}")
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def seed_for(self, sample_index: int) -> int | None:
        return None if self.seed is None else self.seed + sample_index


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageInputs:
    """The images of a prompt: ``png`` the resized images in prompt order (PNG: every engine decodes the same
    pixels), ``pad_id`` the image-pad token, which ``prompt_ids`` holds expanded (the model's view: one pad per
    merged patch). An engine that expands pads itself (SGLang) receives them collapsed to one per image."""

    png: tuple[bytes, ...]
    pad_id: int


def mask_image_targets(
    logprobs: Sequence[float], targets: Sequence[int], images: ImageInputs | None
) -> list[float]:
    """Scored log-probs with those whose target is an image pad set to 0.0 (see ``RolloutEngine.score``)."""
    if images is None:
        return list(logprobs)
    return [0.0 if target == images.pad_id else lp for lp, target in zip(logprobs, targets)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One prompt to sample ``n`` responses for; ``group_id`` ties the samples to their prompt group; ``images``
    the prompt's images (``prompt_ids`` then has their pads expanded).

    ``routed_experts_start``: with ``return_routed_experts``, the routes come back from this position on (SGLang's
    ``routed_experts_start_len``; multi-turn episodes already hold the earlier rows)."""

    prompt_ids: Sequence[int]
    n: int
    sampling: SamplingParams
    return_routed_experts: bool = False
    group_id: int
    routed_experts_start: int = 0
    images: ImageInputs | None = None

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError(f"GenerationRequest(group_id={self.group_id}): prompt_ids is empty")
        if self.n < 1:
            raise ValueError(f"GenerationRequest(group_id={self.group_id}): n must be >= 1, got {self.n}")
        if not 0 <= self.routed_experts_start <= len(self.prompt_ids):
            raise ValueError(
                f"GenerationRequest(group_id={self.group_id}): routed_experts_start {self.routed_experts_start} is "
                f"not in [0, {len(self.prompt_ids)}] (the prompt's length)"
            )
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        if self.images is not None and not self.images.png:
            object.__setattr__(self, "images", None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeInfo:
    """How a multi-turn episode went (slime's sample status): ``status``, engine turns, tool calls made, tool calls
    that failed or timed out (their error became the observation), and why a truncated episode stopped."""

    status: EpisodeStatus
    turns: int
    tool_calls: int = 0
    tool_errors: int = 0
    truncated_by: str | None = None  # max_turns, max_tool_calls, max_context, length

    def __post_init__(self) -> None:
        if self.status not in EPISODE_STATUSES:
            raise ValueError(f"EpisodeInfo.status {self.status!r} is not one of {EPISODE_STATUSES}")


@dataclasses.dataclass(kw_only=True)
class Sample:
    """One sampled response.

    ``rollout_logp[t]`` is the engine's log-probability of ``response_ids[t]`` (see ``cpu_engine`` for the
    temperature convention). ``routed_experts`` (MoE only, when requested) is int32
    ``[len(prompt_ids) + len(response_ids) - 1, num_layers, top_k]``: row ``p`` holds, per layer, the experts chosen
    for the token at position ``p`` of ``prompt_ids + response_ids`` (the last token is never fed to the model).

    Multi-turn episodes: ``response_ids`` is everything after the prompt (engine turns and tool observations),
    ``loss_mask[t]`` is 1 where the policy sampled ``response_ids[t]`` and 0 on observation tokens (whose
    ``rollout_logp`` is 0), and ``episode`` says how the episode went. ``loss_mask=None``: every token was sampled.
    """

    group_id: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logp: list[float]
    finish_reason: FinishReason
    routed_experts: np.ndarray | None = None
    reward_fields: dict[str, Any] = dataclasses.field(default_factory=dict)  # the reward's extra fields
    loss_mask: list[int] | None = None
    episode: EpisodeInfo | None = None
    routed_experts_start: int = 0  # routed_experts holds the rows from this position on (the request's)
    # the engine's version of the forward behind each response token (None: the engine reports none)
    token_versions: list[int] | None = None

    def __post_init__(self) -> None:
        where = f"Sample(group_id={self.group_id}, sample_index={self.sample_index})"
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"{where}: finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")
        if len(self.rollout_logp) != len(self.response_ids):
            raise ValueError(
                f"{where}: {len(self.rollout_logp)} rollout_logp for {len(self.response_ids)} response tokens"
            )
        versions = self.token_versions
        if versions is not None and len(versions) != len(self.response_ids):
            raise ValueError(
                f"{where}: {len(versions)} token_versions for {len(self.response_ids)} response tokens"
            )
        mask = self.loss_mask
        if mask is not None and (len(mask) != len(self.response_ids) or any(m not in (0, 1) for m in mask)):
            raise ValueError(
                f"{where}: loss_mask must hold one 0 or 1 per response token ({len(self.response_ids)}), "
                f"got {len(mask)} values"
            )
        if self.routed_experts is not None:
            expected_rows = max(
                len(self.prompt_ids) + len(self.response_ids) - 1 - self.routed_experts_start, 0
            )
            arr = self.routed_experts
            if arr.ndim != 3 or arr.shape[0] != expected_rows or arr.dtype != np.int32:
                raise ValueError(
                    f"{where}: routed_experts must be int32 [{expected_rows}, num_layers, top_k], "
                    f"got {arr.dtype} {list(arr.shape)}"
                )

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def generated_tokens(self) -> int:
        """Tokens the policy sampled (a single response: all of them; an episode: its mask-1 tokens)."""
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)
