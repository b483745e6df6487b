"""Rollout collection: rewards, group advantages, DAPO dynamic sampling (refills that skip no prompt), aborted
groups and the overlong penalty, with a scripted engine (no model)."""

from __future__ import annotations

import json

import pytest
import torch

from sapo_megatron.algo import AdvantageConfig
from sapo_megatron.data.prompts import PromptIterator, PromptRow
from sapo_megatron.rollout.base import RolloutEngine, RolloutError
from sapo_megatron.rollout.collect import CollectSettings, collect
from sapo_megatron.rollout.types import Sample, SamplingParams


class ScriptedEngine(RolloutEngine):
    """Answers prompt ids ``[k, ...]`` with n responses, the first ``k`` of them correct (token 1), the rest
    wrong (token 0); a prompt ending in ``ABORT`` gets its last sample aborted. Records every request's
    sampling seed and prompt."""

    def __init__(self, response_len: int = 2) -> None:
        self.seeds: list[int | None] = []
        self.prompts: list[list[int]] = []
        self.response_len = response_len

    def generate(self, requests):
        out = []
        for req in requests:
            self.seeds.append(req.sampling.seed)
            self.prompts.append(list(req.prompt_ids))
            correct = req.prompt_ids[0]
            aborts = req.prompt_ids[-1] == ABORT
            out.append(
                [
                    Sample(
                        group_id=req.group_id,
                        sample_index=i,
                        prompt_ids=list(req.prompt_ids),
                        response_ids=[1 if i < correct else 0] * self.response_len,
                        rollout_logp=[-0.5] * self.response_len,
                        finish_reason="abort" if aborts and i == req.n - 1 else "stop",
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


ABORT = 99


def rows(*specs: int | str) -> list[PromptRow]:
    """Prompt ``"k"`` (k of 4 samples correct), ``"k,i"`` (the same, told apart by ``i``), ``"k,abort"``."""
    return [PromptRow(prompt=str(spec), ground_truth="1") for spec in specs]


def encode(row: PromptRow) -> list[int]:
    return [ABORT if part == "abort" else int(part) for part in row.prompt.split(",")]


def settings(**kw) -> CollectSettings:
    base = dict(n_samples=4, sampling=SamplingParams(max_new_tokens=4), advantage=AdvantageConfig())
    return CollectSettings(**{**base, **kw})


def run(engine, prompts, refill_rows=(), scored=None, **kw):
    """:func:`collect` with refills taken, in order, from ``refill_rows``; ``scored`` records scored prompts."""
    queue = list(refill_rows)

    def refill(n: int) -> list[PromptRow]:
        taken, queue[:n] = queue[:n], []
        return taken

    def score(sample, row):
        if scored is not None:
            scored.append(row.prompt)
        return float(sample.response_ids[0] == 1)

    return collect(
        engine, prompts, refill=refill, encode=encode, score=score, settings=settings(**kw), seed=7
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


def test_refill_takes_exactly_the_missing_prompts():
    engine = ScriptedEngine()
    batch = run(
        engine, rows(1, 4, 0, 0), refill_rows=rows(2, 0, 3, "3,1"), dynamic_sampling=True, max_refills=3
    )
    assert [row.prompt for row in batch.prompts] == ["1", "2", "3", "3,1"]
    # round 2 asks for the 3 missing groups, round 3 for the one still missing: no prompt fetched and unused
    assert [p[0] for p in engine.prompts] == [1, 4, 0, 0, 2, 0, 3, 3]
    assert batch.metrics["rollout/rounds"] == 3.0


def test_dynamic_sampling_sees_every_prompt_of_an_epoch_once():
    epoch = [
        PromptRow(prompt=f"{k},{i}", ground_truth="1") for i, k in enumerate([0, 1, 4, 2, 0, 3, 4, 1] * 3)
    ]
    prompts = PromptIterator(epoch, batch_size=4, seed=1)
    engine = ScriptedEngine()
    trained = []
    while len(engine.prompts) < len(epoch):
        batch = run_from(engine, prompts)
        trained += [row.prompt for row in batch.prompts]
        assert bool((batch.rewards.std(dim=1) > 0).all())
    seen = [",".join(map(str, p)) for p in engine.prompts]
    in_order = [epoch[i].prompt for i in prompts.order(0)]
    assert seen[: len(epoch)] == in_order  # every prompt once, in the epoch's order, none skipped
    assert set(trained) == {row.prompt for row in epoch if row.prompt.split(",")[0] in "123"}


def run_from(engine, prompts: PromptIterator, **kw):
    """One trainer step: a batch from ``next(prompts)``, refills from ``prompts.take``."""
    return collect(
        engine,
        next(prompts),
        refill=prompts.take,
        encode=encode,
        score=lambda sample, row: float(sample.response_ids[0] == 1),
        settings=settings(dynamic_sampling=True, max_refills=5, **kw),
        seed=3,
    )


def test_prompt_state_saved_after_refills_resumes_identically():
    epoch = [
        PromptRow(prompt=f"{k},{i}", ground_truth="1") for i, k in enumerate([0, 2, 4, 1, 3, 0, 4, 2] * 2)
    ]
    original = PromptIterator(epoch, batch_size=4, seed=9)
    first = run_from(ScriptedEngine(), original)
    assert first.metrics["rollout/rounds"] > 1  # the state below is taken after refills
    state = json.loads(json.dumps(original.state_dict()))
    resumed = PromptIterator(epoch, batch_size=4, seed=9)
    resumed.load_state_dict(state)
    expected, again = run_from(ScriptedEngine(), original), run_from(ScriptedEngine(), resumed)
    assert [r.prompt for r in again.prompts] == [r.prompt for r in expected.prompts]
    assert torch.equal(again.rewards, expected.rewards)
    assert original.state_dict() == resumed.state_dict()


def test_aborted_groups_are_dropped_unscored_and_refilled():
    engine, scored = ScriptedEngine(), []
    batch = run(engine, rows(1, "2,abort", 4), refill_rows=rows("3,abort", 2), scored=scored, max_refills=2)
    assert [row.prompt for row in batch.prompts] == ["1", "4", "2"]
    assert all(s.finish_reason != "abort" for s in batch.samples)
    assert "2,abort" not in scored and "3,abort" not in scored
    assert batch.metrics["rollout/aborted_groups"] == 2.0
    assert batch.metrics["response/aborted_frac"] == 2 / 20  # 5 groups of 4 came back, 2 samples aborted
    assert batch.metrics["rollout/rounds"] == 3.0


def test_aborted_groups_never_fill_a_short_batch():
    with pytest.raises(RolloutError) as err:
        run(ScriptedEngine(), rows(1, "2,abort"), refill_rows=rows("3,abort", "1,abort"), max_refills=1)
    assert str(err.value).startswith(
        "only 1 of 2 prompt groups could be completed in 2 rollout rounds: 2 groups had samples that the "
        "rollout engine aborted"
    )
    assert "algorithm.max_refills" in err.value.hint
    # with dynamic sampling an all-equal group may still fill in (zero advantage), an aborted one may not
    batch = run(
        ScriptedEngine(), rows(1, "2,abort"), refill_rows=rows(4), dynamic_sampling=True, max_refills=1
    )
    assert [row.prompt for row in batch.prompts] == ["1", "4"] and batch.metrics[
        "rollout/kept_group_frac"
    ] == 0.5


def test_over_sampling_draws_more_prompts_and_keeps_the_first_that_pass():
    """Two groups wanted, 1.5× drawn: "4" is all-correct (dropped by dynamic sampling), "2" fills its place in the
    same round; without over-sampling that takes a second round."""
    engine = ScriptedEngine()
    batch = run(engine, rows(1, 4), refill_rows=rows(2, 3, "3,1"), dynamic_sampling=True, over_sampling=1.5)
    assert [row.prompt for row in batch.prompts] == ["1", "2"]
    assert [p[0] for p in engine.prompts] == [1, 4, 2]
    assert batch.metrics["rollout/rounds"] == 1.0 and batch.metrics["rollout/over_sampled_prompts"] == 1.0
    assert batch.metrics["rollout/unused_groups"] == 1.0  # "4": scored, not trained
    plain = run(ScriptedEngine(), rows(1, 4), refill_rows=rows(2, 3), dynamic_sampling=True, max_refills=2)
    assert plain.metrics["rollout/rounds"] == 2.0 and plain.metrics["rollout/over_sampled_prompts"] == 0.0
    # a refill round over-samples too: 3 wanted, 2 missing after round one → 3 drawn
    engine = ScriptedEngine()
    batch = run(
        engine,
        rows(1, 4, 0),
        refill_rows=rows(0, 2, 3, "3,1"),
        dynamic_sampling=True,
        over_sampling=1.2,
        max_refills=2,
    )
    assert [p[0] for p in engine.prompts] == [1, 4, 0, 0, 2, 3, 3]
    assert [row.prompt for row in batch.prompts] == ["1", "2", "3"]
    assert batch.metrics["rollout/over_sampled_prompts"] == 2.0  # ceil(3 × 1.2) - 3 + ceil(2 × 1.2) - 2
