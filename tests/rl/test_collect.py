"""Rollout collection: rewards, group advantages, DAPO dynamic sampling and the overlong penalty, with a
scripted engine (no model)."""

from __future__ import annotations

import torch

from sapo_megatron.algo import AdvantageConfig
from sapo_megatron.data.prompts import PromptRow
from sapo_megatron.rollout.base import RolloutEngine
from sapo_megatron.rollout.collect import CollectSettings, collect
from sapo_megatron.rollout.types import Sample, SamplingParams


class ScriptedEngine(RolloutEngine):
    """Answers each prompt ``"<k>"`` with n responses, the first ``k`` of them correct (token 1), the rest
    wrong (token 0); records every request's sampling seed."""

    def __init__(self, response_len: int = 2) -> None:
        self.seeds: list[int | None] = []
        self.response_len = response_len

    def generate(self, requests):
        out = []
        for req in requests:
            self.seeds.append(req.sampling.seed)
            correct = req.prompt_ids[0]
            out.append(
                [
                    Sample(
                        group_id=req.group_id,
                        sample_index=i,
                        prompt_ids=list(req.prompt_ids),
                        response_ids=[1 if i < correct else 0] * self.response_len,
                        rollout_logp=[-0.5] * self.response_len,
                        finish_reason="stop",
                    )
                    for i in range(req.n)
                ]
            )
        return out

    def score(self, token_ids_list, response_start):
        raise NotImplementedError

    def update_weights_from_disk(self, path):
        pass

    def update_weights_from_tensors(self, named_tensors):
        pass

    def flush_cache(self):
        pass

    def health(self):
        return True

    def close(self):
        pass


def rows(*correct_counts: int) -> list[PromptRow]:
    return [PromptRow(prompt=str(k), ground_truth="1") for k in correct_counts]


def settings(**kw) -> CollectSettings:
    base = dict(n_samples=4, sampling=SamplingParams(max_new_tokens=4), advantage=AdvantageConfig())
    return CollectSettings(**{**base, **kw})


def run(engine, prompts, refill_rows=(), **kw):
    return collect(
        engine,
        prompts,
        refill=iter([refill_rows] * 10),
        encode=lambda row: [int(row.prompt)],
        score=lambda sample, row: float(sample.response_ids[0] == 1),
        settings=settings(**kw),
        seed=7,
    )


def test_rewards_and_group_advantages():
    batch = run(ScriptedEngine(), rows(1, 4))
    assert batch.rewards.tolist() == [[1, 0, 0, 0], [1, 1, 1, 1]]
    assert batch.advantages[1].tolist() == [0, 0, 0, 0]  # constant group: no signal
    assert batch.advantages[0, 0] > 0 > batch.advantages[0, 1]
    assert batch.metrics["reward/mean"] == 5 / 8
    assert batch.metrics["rollout/kept_group_frac"] == 1.0


def test_dynamic_sampling_replaces_constant_groups():
    batch = run(ScriptedEngine(), rows(1, 4, 0), refill_rows=rows(2, 3), dynamic_sampling=True, max_refills=2)
    assert [row.prompt for row in batch.prompts] == ["1", "2", "3"]
    assert bool((batch.rewards.std(dim=1) > 0).all())
    assert batch.metrics["rollout/rounds"] == 2.0


def test_dynamic_sampling_fills_with_dropped_groups_when_refills_run_out():
    batch = run(ScriptedEngine(), rows(4, 1), refill_rows=rows(0), dynamic_sampling=True, max_refills=1)
    assert len(batch.groups) == 2
    assert batch.metrics["rollout/kept_group_frac"] == 0.5


def test_overlong_penalty_is_added():
    engine = ScriptedEngine(response_len=4)  # L_max = 4, cache 2: length 4 sits at the end of the window
    batch = run(engine, rows(4), overlong_cache_len=2)
    assert torch.allclose(batch.rewards, torch.full((1, 4), 1.0 - 1.0))


def test_sampling_seeds_are_distinct_and_reproducible():
    first, second = ScriptedEngine(), ScriptedEngine()
    run(first, rows(1, 2, 3))
    run(second, rows(1, 2, 3))
    assert first.seeds == second.seeds
    assert len(set(first.seeds)) == 3
