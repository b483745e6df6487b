"""Rewards: the built-in verifiers (exact / numeric / math-verify / DAPO / code execution), user rewards by import
path, remote reward servers, and the runner that scores batches inline or in a pool of worker processes (see
docs/rewards.md). Nothing here imports torch: the pool's workers import this package."""

from sapo_megatron.rewards.answers import (
    exact_match,
    extract_final_answer,
    extract_last_number,
    last_boxed,
    numeric_match,
)
from sapo_megatron.rewards.code_exec import code_exec
from sapo_megatron.rewards.dapo import dapo_math
from sapo_megatron.rewards.math_verify_reward import math_verify_available, math_verify_reward
from sapo_megatron.rewards.registry import (
    RewardError,
    RewardFn,
    SafeReward,
    available_rewards,
    get_reward,
    register_reward,
    safe_reward,
)
from sapo_megatron.rewards.runner import (
    RewardRunner,
    RewardSpec,
    build_reward_runner,
    check_reward_available,
    check_reward_spec,
)
from sapo_megatron.rewards.types import RewardInput, RewardOutput, group_reward

__all__ = [
    "RewardError",
    "RewardFn",
    "RewardInput",
    "RewardOutput",
    "RewardRunner",
    "RewardSpec",
    "SafeReward",
    "available_rewards",
    "build_reward_runner",
    "check_reward_available",
    "check_reward_spec",
    "code_exec",
    "dapo_math",
    "exact_match",
    "extract_final_answer",
    "extract_last_number",
    "get_reward",
    "group_reward",
    "last_boxed",
    "math_verify_available",
    "math_verify_reward",
    "numeric_match",
    "register_reward",
    "safe_reward",
]
