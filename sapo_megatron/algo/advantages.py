"""Outcome advantages per prompt group, DAPO dynamic-sampling filter and soft overlong penalty.

Rewards are ``[num_groups, group_size]``: row g holds the rewards of the G responses to prompt g.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


def grpo_advantages(
    rewards_g_n: torch.Tensor, *, eps: float = 1e-6, std_normalize: bool = True, batch_std: bool = False
) -> torch.Tensor:
    """Group-relative advantages ``[num_groups, group_size]`` (fp32).

    GRPO (DeepSeekMath arXiv:2402.03300): ``(R_i − mean_j R_j) / (std_j R_j + eps)``, with the sample (unbiased)
    std as in verl and TRL. Dr.GRPO (arXiv:2503.20783, ``std_normalize=False``): ``R_i − mean_j R_j``, since the
    std division over-weights groups that are nearly all right or all wrong. A constant group gets 0.
    ``batch_std``: divide by the std of all the batch's rewards instead of each group's (TRL's
    ``scale_rewards="batch"``, ``GRPOTrainer._generate_and_score_completions``: ``rewards.std()``).
    """
    rewards = rewards_g_n.float()
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    # Exact 0 for constant groups: fp32 rounding of the mean (e.g. rewards of 0.7) would otherwise leave ~1e-8
    # residues that the std division (std ~1e-8, eps 1e-6) blows up into advantages of a few percent.
    centred = torch.where(nonconstant_groups(rewards)[:, None], rewards - rewards.mean(-1, keepdim=True), 0.0)
    if not std_normalize:
        return centred
    if batch_std:
        return centred / (rewards.std() + eps) if rewards.numel() > 1 else centred
    if rewards.shape[-1] < 2:
        raise ValueError("GRPO std normalisation needs group_size >= 2 (use drgrpo or larger groups)")
    return centred / (rewards.std(-1, keepdim=True) + eps)


def nonconstant_groups(rewards_g_n: torch.Tensor) -> torch.Tensor:
    """Bool ``[num_groups]``: True where the rewards are not all equal. DAPO dynamic sampling (arXiv:2503.14476)
    keeps only these groups, since a constant group has zero advantage and gives no gradient."""
    return rewards_g_n.amax(-1) > rewards_g_n.amin(-1)


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv:2503.14476, eq. 13), fp32, same shape as ``lengths``.

    0 for ``|y| <= max_len − cache_len``; ``((max_len − cache_len) − |y|) / cache_len`` inside the window
    (reaching −1 at ``max_len``); −1 beyond ``max_len``.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"overlong penalty needs 0 < cache_len <= max_len, got {cache_len=}, {max_len=}")
    penalty = ((max_len - cache_len) - lengths.float()) / cache_len
    return penalty.clamp(min=-1.0, max=0.0)


class AdvantageConfig(BaseModel):
    """``grpo``: std-normalised group advantages; ``drgrpo``: mean-centred only (``eps`` does not apply)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["grpo", "drgrpo"] = "grpo"
    eps: float = Field(1e-6, gt=0, description="added to the group std (grpo only)")
    scale: Literal["group", "batch"] = Field(
        "group",
        description="grpo: divide by each group's reward std (group) or by the whole batch's (batch, TRL's "
        "scale_rewards='batch'); the mean is always the group's",
    )

    @model_validator(mode="after")
    def _eps_only_for_grpo(self) -> AdvantageConfig:
        # An accepted setting must change behaviour: refuse eps where nothing divides by the std.
        if self.name == "drgrpo" and "eps" in self.model_fields_set:
            raise ValueError("eps only applies to name='grpo' (std normalisation); remove it for drgrpo")
        if self.name == "drgrpo" and "scale" in self.model_fields_set:
            raise ValueError("scale only applies to name='grpo' (std normalisation); remove it for drgrpo")
        return self

    def compute(self, rewards_g_n: torch.Tensor) -> torch.Tensor:
        """Advantages ``[num_groups, group_size]`` for rewards ``[num_groups, group_size]``."""
        return grpo_advantages(
            rewards_g_n, eps=self.eps, std_normalize=self.name == "grpo", batch_std=self.scale == "batch"
        )
