"""Verifiable rewards: exact / numeric answers, math answers through math-verify, a registry and a safety wrapper."""

from sapo_megatron.rewards.answers import (
    exact_match,
    extract_final_answer,
    extract_last_number,
    numeric_match,
)
from sapo_megatron.rewards.math_verify_reward import math_verify_available, math_verify_reward
from sapo_megatron.rewards.registry import (
    RewardError,
    RewardFn,
    SafeReward,
    available_rewards,
    check_reward_available,
    get_reward,
    register_reward,
    safe_reward,
)

__all__ = [
    "RewardError",
    "RewardFn",
    "SafeReward",
    "available_rewards",
    "check_reward_available",
    "exact_match",
    "extract_final_answer",
    "extract_last_number",
    "get_reward",
    "math_verify_available",
    "math_verify_reward",
    "numeric_match",
    "register_reward",
    "safe_reward",
]
