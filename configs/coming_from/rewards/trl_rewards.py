"""Reward functions as a TRL GRPOTrainer user writes them: lists in, one float per completion out, dataset
columns (here ``solution``) as keyword lists (docs/coming_from.md, docs/rewards.md)."""

import re


def accuracy_reward(completions, solution, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, answer in zip(contents, solution):
        numbers = re.findall(r"-?\d+", content)
        rewards.append(1.0 if numbers and numbers[-1] == answer else 0.0)
    return rewards
