"""One rollout batch: prompts → n samples each → rewards → group advantages, with DAPO dynamic sampling.

The trainer calls :func:`collect` on the rank that drives the engine; everything here is engine-agnostic.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from sapo_megatron.algo import AdvantageConfig, nonconstant_groups, overlong_penalty
from sapo_megatron.data.prompts import PromptRow
from sapo_megatron.rollout.base import RolloutEngine
from sapo_megatron.rollout.types import GenerationRequest, Sample, SamplingParams


@dataclass(frozen=True)
class CollectSettings:
    """What :func:`collect` needs from the run config."""

    n_samples: int
    sampling: SamplingParams
    advantage: AdvantageConfig
    dynamic_sampling: bool = False
    max_refills: int = 0
    overlong_cache_len: int | None = None
    return_routed_experts: bool = False


@dataclass
class RolloutBatch:
    """Kept groups of samples with their rewards and advantages, both ``[groups, n]``."""

    prompts: list[PromptRow]
    groups: list[list[Sample]]
    rewards: torch.Tensor
    advantages: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [s for group in self.groups for s in group]


Encode = Callable[[PromptRow], list[int]]
Score = Callable[[Sample, PromptRow], float]


def generate_groups(
    engine: RolloutEngine, prompts: Sequence[PromptRow], encode: Encode, settings: CollectSettings, seed: int
) -> list[list[Sample]]:
    """``n_samples`` responses per prompt; sampling seeds derive from ``seed`` so a resumed run repeats them."""
    requests = [
        GenerationRequest(
            prompt_ids=encode(row),
            n=settings.n_samples,
            sampling=dataclasses.replace(settings.sampling, seed=seed * 100_003 + index * settings.n_samples),
            return_routed_experts=settings.return_routed_experts,
            group_id=index,
        )
        for index, row in enumerate(prompts)
    ]
    return engine.generate(requests)


def score_groups(
    groups: list[list[Sample]], prompts: Sequence[PromptRow], score: Score, settings: CollectSettings
):
    """Rewards ``[groups, n]``, plus the DAPO soft overlong penalty when configured."""
    rewards = torch.tensor([[score(s, row) for s in group] for group, row in zip(groups, prompts)])
    if settings.overlong_cache_len:
        lengths = torch.tensor([[len(s.response_ids) for s in group] for group in groups])
        rewards = rewards + overlong_penalty(
            lengths, max_len=settings.sampling.max_new_tokens, cache_len=settings.overlong_cache_len
        )
    return rewards.float()


def collect(
    engine: RolloutEngine,
    prompts: list[PromptRow],
    *,
    refill: Iterator[list[PromptRow]],
    encode: Encode,
    score: Score,
    settings: CollectSettings,
    seed: int,
) -> RolloutBatch:
    """Generate and score one batch of ``len(prompts)`` groups.

    With dynamic sampling, groups whose rewards are all equal (zero advantage everywhere) are dropped and
    replaced by groups of fresh prompts from ``refill``, for at most ``max_refills`` extra rounds; if the batch is
    still short, the dropped groups fill it (they carry zero advantage), and ``rollout/kept_group_frac`` says so.
    """
    start, wanted = time.perf_counter(), len(prompts)
    kept: list[tuple[PromptRow, list[Sample], torch.Tensor]] = []
    dropped: list[tuple[PromptRow, list[Sample], torch.Tensor]] = []
    batch_prompts, rounds = prompts, 0
    while True:
        groups = generate_groups(engine, batch_prompts, encode, settings, seed * 31 + rounds)
        rewards = score_groups(groups, batch_prompts, score, settings)
        informative = (
            nonconstant_groups(rewards) if settings.dynamic_sampling else torch.ones(len(groups), dtype=bool)
        )
        for row, group, reward, keep in zip(batch_prompts, groups, rewards, informative.tolist()):
            (kept if keep else dropped).append((row, group, reward))
        rounds += 1
        if len(kept) >= wanted or rounds > settings.max_refills:
            break
        batch_prompts = next(refill)[: wanted - len(kept)]
    chosen = (kept + dropped)[:wanted]
    rewards = torch.stack([reward for _, _, reward in chosen])
    batch = RolloutBatch(
        prompts=[row for row, _, _ in chosen],
        groups=[group for _, group, _ in chosen],
        rewards=rewards,
        advantages=settings.advantage.compute(rewards),
    )
    batch.metrics = _rollout_metrics(batch, kept_groups=min(len(kept), wanted), rounds=rounds, wanted=wanted)
    batch.metrics["time/rollout_s"] = time.perf_counter() - start
    return batch


def _rollout_metrics(batch: RolloutBatch, *, kept_groups: int, rounds: int, wanted: int) -> dict[str, float]:
    samples = batch.samples
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    truncated = sum(s.finish_reason == "length" for s in samples)
    aborted = sum(s.finish_reason == "abort" for s in samples)
    return {
        "reward/mean": float(batch.rewards.mean()),
        "reward/std": float(batch.rewards.std()) if batch.rewards.numel() > 1 else 0.0,
        "reward/group_std_mean": float(batch.rewards.std(dim=1).mean())
        if batch.rewards.shape[1] > 1
        else 0.0,
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": truncated / len(samples),
        "response/aborted_frac": aborted / len(samples),
        "rollout/kept_group_frac": kept_groups / wanted,
        "rollout/rounds": float(rounds),
        "rollout/tokens": float(lengths.sum()),
    }
