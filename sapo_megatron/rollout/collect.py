"""One rollout batch: prompts → n samples each → rewards → group advantages, with DAPO dynamic sampling.

The trainer calls :func:`collect` on the rank that drives the engine; everything here is engine-agnostic.
A group with an aborted sample is never trained (its group statistics would be biased); like an uninformative
group under dynamic sampling, it is replaced by a group of a fresh prompt.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sapo_megatron.algo import AdvantageConfig, nonconstant_groups, overlong_penalty
from sapo_megatron.data.prompts import PromptRow
from sapo_megatron.rollout.base import RolloutEngine, RolloutError
from sapo_megatron.rollout.episodes.runner import episode_metrics
from sapo_megatron.rollout.types import GenerationRequest, ImageInputs, Sample, SamplingParams


@dataclass(frozen=True)
class CollectSettings:
    """What :func:`collect` needs from the run config."""

    n_samples: int
    sampling: SamplingParams
    advantage: AdvantageConfig
    dynamic_sampling: bool = False
    max_refills: int = 0
    over_sampling: float = 1.0
    overlong_cache_len: int | None = None
    return_routed_experts: bool = False
    image_pad_id: int | None = None  # the tokenizer's <|image_pad|> when prompts have images
    mask_truncated: bool = False  # algorithm.mask_truncated_completions


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
BatchScore = Callable[[list[list[Sample]], Sequence[PromptRow]], list[list[float]]]
"""Scores ``[groups][n]`` of a whole generation round at once (e.g. one reward-pool call)."""
Refill = Callable[[int], Sequence[PromptRow]]
"""``refill(n)``: the next ``n`` prompts of the data order (e.g. ``PromptIterator.take``); fewer when the data
runs out."""
Scored = tuple[PromptRow, list[Sample], torch.Tensor]
OnGenerated = Callable[[Sequence[PromptRow], list[list[Sample]]], None]
"""Called with each generation round's prompts and groups before they are scored (e.g. to start teacher scoring,
which then overlaps with the reward computation)."""


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
            images=prompt_images(row, settings.image_pad_id),
        )
        for index, row in enumerate(prompts)
    ]
    return engine.generate(requests)


def prompt_images(row: PromptRow, image_pad_id: int | None) -> ImageInputs | None:
    """What an engine receives with ``row``'s prompt: its resized images as PNGs (None without images)."""
    if not row.images:
        return None
    if image_pad_id is None:
        raise RolloutError("a prompt has images and the rollout settings name no image-pad token")
    return ImageInputs(png=tuple(image.png() for image in row.images), pad_id=image_pad_id)


def per_sample(score: Score) -> BatchScore:
    return lambda groups, prompts: [[score(s, row) for s in group] for group, row in zip(groups, prompts)]


def score_groups(
    groups: list[list[Sample]], prompts: Sequence[PromptRow], score: BatchScore, settings: CollectSettings
):
    """Rewards ``[groups, n]``, plus the DAPO soft overlong penalty when configured."""
    rewards = torch.tensor(score(groups, prompts), dtype=torch.float32).reshape(len(groups), -1)
    if settings.overlong_cache_len:
        lengths = torch.tensor([[s.generated_tokens for s in group] for group in groups])
        rewards = rewards + overlong_penalty(
            lengths, max_len=settings.sampling.max_new_tokens, cache_len=settings.overlong_cache_len
        )
    return rewards.float()


def collect(
    engine: RolloutEngine,
    prompts: list[PromptRow],
    *,
    refill: Refill,
    encode: Encode,
    score: Score | None = None,
    settings: CollectSettings,
    seed: int,
    on_generated: OnGenerated | None = None,
    score_batch: BatchScore | None = None,
) -> RolloutBatch:
    """Generate and score one batch of ``len(prompts)`` groups.

    Groups with a sample the engine aborted (``finish_reason == "abort"``, still so after the client's retries)
    are dropped unscored, and counted in ``rollout/aborted_groups``. With dynamic sampling, groups whose rewards
    are all equal (zero advantage everywhere) are dropped too. Dropped groups are replaced by groups of exactly
    as many fresh prompts from ``refill`` (the data order continues: no prompt is skipped), for at most
    ``max_refills`` extra rounds. With ``over_sampling`` > 1 each round draws that many times the prompts it needs
    (rounded up) and the first groups that pass, in data order, are kept (``rollout/over_sampled_prompts``,
    ``rollout/unused_groups``). Rewards come from ``score_batch`` (one call per generation round) or, per
    sample, from ``score``. If the batch is then still short, the all-equal groups fill it (zero
    advantage; ``rollout/kept_group_frac`` says so); aborted groups never do: :class:`RolloutError` if the
    batch cannot be completed without them.
    """
    start, wanted = time.perf_counter(), len(prompts)
    if score_batch is not None:
        score_round = score_batch
    elif score is not None:
        score_round = per_sample(score)
    else:
        raise ValueError("collecting a batch needs score or score_batch")
    pool = _GroupPool()
    over_sampled = _extra(wanted, settings.over_sampling)
    batch_prompts, rounds = [*prompts, *(refill(over_sampled) if over_sampled else ())], 0
    while batch_prompts:
        groups = generate_groups(engine, batch_prompts, encode, settings, seed * 31 + rounds)
        rounds += 1
        if on_generated is not None:
            on_generated(batch_prompts, groups)
        pool.add(batch_prompts, groups, score_round, settings)
        if len(pool.informative) >= wanted or rounds > settings.max_refills:
            break
        missing = wanted - len(pool.informative)
        extra = _extra(missing, settings.over_sampling)
        over_sampled += extra
        batch_prompts = list(refill(missing + extra))
    chosen = (pool.informative + pool.uninformative)[:wanted]
    if len(chosen) < wanted:
        raise _incomplete_batch(len(chosen), wanted, rounds, pool.aborted_groups)
    rewards = torch.stack([reward for _, _, reward in chosen])
    batch = RolloutBatch(
        prompts=[row for row, _, _ in chosen],
        groups=[group for _, group, _ in chosen],
        rewards=rewards,
        advantages=settings.advantage.compute(rewards),
    )
    kept_groups = min(len(pool.informative), wanted)
    batch.metrics = _rollout_metrics(batch, kept_groups=kept_groups, rounds=rounds, wanted=wanted)
    batch.metrics.update(episode_metrics(batch.samples))  # turns, tool calls, truncations (multi-turn)
    batch.metrics["rollout/aborted_groups"] = float(pool.aborted_groups)
    scored_groups = len(pool.informative) + len(pool.uninformative)
    # scored but not trained: dropped by dynamic sampling, or drawn beyond the batch by over-sampling
    batch.metrics["rollout/unused_groups"] = float(max(scored_groups - wanted, 0))
    batch.metrics["rollout/over_sampled_prompts"] = float(over_sampled)
    batch.metrics["response/aborted_frac"] = pool.aborted_samples / max(pool.samples, 1)  # all that came back
    batch.metrics["time/rollout_s"] = time.perf_counter() - start
    if settings.mask_truncated:
        batch.metrics["response/masked_truncated_frac"] = mask_truncated(batch.samples)
    return batch


def mask_truncated(samples: Sequence[Sample]) -> float:
    """TRL's ``mask_truncated_completions``: a response cut by the token limit (``finish_reason: length``) gets
    loss mask 0 – it still counted in its group's mean and std – so no gradient flows through a cut answer;
    returns the share masked. Runs after the rollout metrics, which see the responses as generated."""
    cut = [s for s in samples if s.finish_reason == "length"]
    for sample in cut:
        sample.loss_mask = [0] * len(sample.response_ids)
    return len(cut) / max(len(samples), 1)


def _extra(needed: int, over_sampling: float) -> int:
    """Prompts drawn beyond ``needed`` under ``over_sampling`` (1.0: none)."""
    return math.ceil(needed * over_sampling - 1e-9) - needed


@dataclass
class _GroupPool:
    """The groups generated for one batch so far, sorted by what they are good for."""

    informative: list[Scored] = field(default_factory=list)  # trained first
    uninformative: list[Scored] = field(default_factory=list)  # all-equal rewards (dynamic sampling only)
    aborted_groups: int = 0  # never scored, never trained
    aborted_samples: int = 0
    samples: int = 0

    def add(
        self,
        prompts: Sequence[PromptRow],
        groups: list[list[Sample]],
        score: BatchScore,
        settings: CollectSettings,
    ) -> None:
        complete = []
        for row, group in zip(prompts, groups):
            aborted = sum(s.finish_reason == "abort" for s in group)
            self.samples += len(group)
            self.aborted_samples += aborted
            self.aborted_groups += aborted > 0
            if not aborted:
                complete.append((row, group))
        if not complete:
            return
        rewards = score_groups([g for _, g in complete], [row for row, _ in complete], score, settings)
        if settings.dynamic_sampling:
            keep = nonconstant_groups(rewards).tolist()
        else:
            keep = [True] * len(complete)
        for (row, group), reward, kept in zip(complete, rewards, keep):
            (self.informative if kept else self.uninformative).append((row, group, reward))


def _incomplete_batch(groups: int, wanted: int, rounds: int, aborted_groups: int) -> RolloutError:
    error = RolloutError(
        f"only {groups} of {wanted} prompt groups could be completed in {rounds} rollout rounds: "
        f"{aborted_groups} groups had samples that the rollout engine aborted (even after the client's retries), "
        "and aborted samples are never trained"
    )
    error.hint = (
        "check the rollout servers (logs, health, memory); raise rollout.timeout_s or rollout.max_retries, or "
        "algorithm.max_refills to refill more rounds"
    )
    return error


def _rollout_metrics(batch: RolloutBatch, *, kept_groups: int, rounds: int, wanted: int) -> dict[str, float]:
    samples = batch.samples
    lengths = torch.tensor(
        [s.generated_tokens for s in samples], dtype=torch.float32
    )  # episodes: no tool tokens
    truncated = sum(s.finish_reason == "length" for s in samples)
    return {
        "reward/mean": float(batch.rewards.mean()),
        "reward/std": float(batch.rewards.std()) if batch.rewards.numel() > 1 else 0.0,
        "reward/group_std_mean": float(batch.rewards.std(dim=1).mean())
        if batch.rewards.shape[1] > 1
        else 0.0,
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": truncated / len(samples),
        "rollout/kept_group_frac": kept_groups / wanted,
        "rollout/rounds": float(rounds),
        "rollout/tokens": float(lengths.sum()),
    }
