"""TRL parity (issue 38, item 4): ``scale_rewards="batch"`` and ``mask_truncated_completions``, checked against
TRL's formulas (``trl/trainer/grpo_trainer.py``: advantages ``(r - group mean) / (std + eps)`` with the std of
the whole batch; truncated completions get completion mask 0 after the rewards' statistics)."""

from __future__ import annotations

import pytest
import torch

from sapo_megatron.algo import AdvantageConfig
from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.data.prompts import PromptRow
from sapo_megatron.defaults import embedded_default_dict
from sapo_megatron.rollout.collect import CollectSettings, collect
from sapo_megatron.rollout.types import Sample, SamplingParams

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]])


def test_batch_scaling_divides_by_the_batch_std_as_trl():
    """Fails on 3855bb6 (no such setting): TRL's scale_rewards="batch", by hand."""
    eps = 1e-4
    group_mean = REWARDS.mean(dim=1, keepdim=True)
    expected = (REWARDS - group_mean) / (REWARDS.std() + eps)  # TRL: rewards.std() over the whole batch
    got = AdvantageConfig(scale="batch", eps=eps).compute(REWARDS)
    torch.testing.assert_close(got, expected)
    assert got[2].abs().sum() == 0  # a constant group: no advantage, as in TRL
    per_group = AdvantageConfig(eps=eps).compute(REWARDS)
    assert not torch.allclose(per_group[:2], got[:2])  # the group std differs from the batch's
    cfg = config_from_dict(
        {**embedded_default_dict(), "algorithm": {"advantage": {"name": "grpo", "scale": "batch"}}}
    )
    assert cfg.algorithm.advantage.scale == "batch"
    with pytest.raises(ConfigError, match="scale only applies to name='grpo'"):
        config_from_dict(
            {**embedded_default_dict(), "algorithm": {"advantage": {"name": "drgrpo", "scale": "batch"}}}
        )


class CutEngine:
    """Sample i of each group: i + 1 tokens; the last of each group is cut by the token limit."""

    def generate(self, requests):
        return [
            [
                Sample(
                    group_id=r.group_id,
                    sample_index=i,
                    prompt_ids=list(r.prompt_ids),
                    response_ids=[7] * (i + 1),
                    rollout_logp=[0.0] * (i + 1),
                    finish_reason="length" if i == r.n - 1 else "stop",
                )
                for i in range(r.n)
            ]
            for r in requests
        ]


@pytest.mark.parametrize("mask", [False, True])
def test_truncated_responses_count_in_the_group_but_train_nothing(mask):
    """Fails on 3855bb6 (no such setting): the cut response still had its reward in the group's mean and std
    (TRL masks after computing advantages) and loss mask 0 when asked."""
    settings = CollectSettings(
        n_samples=4,
        sampling=SamplingParams(max_new_tokens=4),
        advantage=AdvantageConfig(),
        mask_truncated=mask,
    )
    rows = [PromptRow("p", "1"), PromptRow("q", "1")]
    scores = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]
    batch = collect(
        CutEngine(),
        rows,
        refill=lambda n: [],
        encode=lambda row: [1, 2],
        settings=settings,
        seed=0,
        score_batch=lambda groups, prompts: scores,
    )
    torch.testing.assert_close(batch.advantages, AdvantageConfig().compute(torch.tensor(scores)))
    masks = [s.loss_mask for s in batch.samples]
    if not mask:
        assert masks == [None] * 8 and "response/masked_truncated_frac" not in batch.metrics
        return
    assert masks == [None, None, None, [0, 0, 0, 0]] * 2
    assert batch.metrics["response/masked_truncated_frac"] == 0.25
    assert (
        batch.metrics["response/truncated_frac"] == 0.25
    )  # the rollout metrics saw the responses as generated
