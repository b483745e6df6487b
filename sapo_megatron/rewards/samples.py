"""The sample → reward path shared by training, evaluation and teacher scoring: decode a batch of groups, score
it in ONE :meth:`RewardRunner.score` call (so the pool works in parallel), and keep the reward's fields on each
sample (``Sample.reward_fields``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sapo_megatron.data.thinking import split_thinking
from sapo_megatron.rewards.runner import RewardRunner
from sapo_megatron.rewards.types import RewardInput


def reward_inputs(
    groups: Sequence[Sequence[Any]],
    prompts: Sequence[Any],
    decode: Callable[[list[int]], str],
    *,
    after_thinking: bool = False,
) -> list[RewardInput]:
    """One :class:`RewardInput` per sample (groups flattened in order); the prompt text is the decoded prompt
    ids the engine received, the label the row's ``ground_truth``, the source its ``domain``. ``after_thinking``:
    the response is the text after the thinking block (:func:`~sapo_megatron.data.thinking.split_thinking`; a
    response cut while thinking is the empty string)."""
    inputs = []
    for group_id, (group, row) in enumerate(zip(groups, prompts)):
        prompt_text = decode(list(group[0].prompt_ids)) if group else ""
        for sample in group:
            inputs.append(
                RewardInput(
                    response=_response(decode(list(sample.response_ids)), after_thinking),
                    label=row.ground_truth,
                    prompt=prompt_text,
                    source=row.domain,
                    metadata=getattr(row, "metadata", None),
                    group_id=group_id,
                    messages=row.prompt if isinstance(row.prompt, list) else None,
                    columns=getattr(row, "columns", None),
                )
            )
    return inputs


def _response(text: str, after_thinking: bool) -> str:
    return split_thinking(text)[1] if after_thinking else text


def score_sample_groups(
    runner: RewardRunner,
    groups: Sequence[Sequence[Any]],
    prompts: Sequence[Any],
    decode: Callable[[list[int]], str],
) -> list[list[float]]:
    """Scores ``[groups][n]`` of the samples; sets each sample's ``reward_fields`` (with ``reward_error`` when
    the reward failed on it). The runner's ``after_thinking`` says which text the reward sees."""
    inputs = reward_inputs(groups, prompts, decode, after_thinking=runner.after_thinking)
    scored = runner.score(inputs)
    if len(scored) != len(inputs):  # a reward backend lost track of its work: never pair scores wrongly
        from sapo_megatron.rewards.types import RewardError

        raise RewardError(f"reward {runner.name!r} returned {len(scored)} results for {len(inputs)} samples")
    outputs = iter(scored)
    scores = []
    for group in groups:
        row_scores = []
        for sample in group:
            out = next(outputs)
            sample.reward_fields = dict(out.fields, **({"reward_error": out.error} if out.error else {}))
            row_scores.append(out.score)
        scores.append(row_scores)
    return scores
