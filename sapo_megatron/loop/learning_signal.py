"""Warnings where a run would learn nothing, said once and early, with the likely causes.

- :func:`check_sft_targets` (before the warm start, and in ``train --dry-run``: :func:`dry_run_sft_check`): the reward scores a few SFT targets (as a response, against
  their own label). When none scores above the lowest score, SFT teaches a format the reward never rewards – a
  verl GSM8K reward wants ``#### 72`` while the default target is the bare label ``72``. It names the row fields
  whose text does score (``data.response_key: extra_info.answer``).
- :class:`NoSignalWatch` (each RL step): when every group's rewards were equal for :data:`PATIENCE` steps in a row,
  every advantage is zero and the policy gets no gradient: one warning with the causes to check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sapo_megatron.data.conversation import first_turn_call, is_conversation
from sapo_megatron.data.prompts import PromptRow
from sapo_megatron.data.render import sft_target
from sapo_megatron.rewards.types import RewardInput, RewardOutput

if TYPE_CHECKING:
    from sapo_megatron.config import RunConfig

logger = logging.getLogger(__name__)

TARGETS_SCORED = 16
"""SFT targets scored by :func:`check_sft_targets` (the first rows: a check, not an evaluation)."""
FIELD_ROWS, FIELDS_TRIED = 4, 12
"""Rows and row fields :func:`scoring_fields` tries."""
PATIENCE = 3
"""RL steps in a row with zero reward spread in every group before :class:`NoSignalWatch` warns."""


class Scorer(Protocol):
    """What these checks call of the run's reward (a :class:`~sapo_megatron.rewards.runner.RewardRunner`)."""

    @property
    def name(self) -> str: ...
    def score(self, inputs: list[RewardInput]) -> list[RewardOutput]: ...
    def take_step_metrics(self) -> dict[str, float]: ...


def _inputs(rows: Sequence[PromptRow], texts: Sequence[str]) -> list[RewardInput]:
    return [
        RewardInput(
            response=text,
            label=row.ground_truth,
            source=row.domain,
            metadata=row.metadata,
            messages=row.prompt if isinstance(row.prompt, list) else None,
            columns=row.columns,
        )
        for row, text in zip(rows, texts)
    ]


def _text_fields(value: Any, prefix: str = "", depth: int = 2) -> Iterator[tuple[str, str]]:
    """``(dotted path, text)`` of the string values of a row's columns, nested dicts to ``depth`` levels."""
    if isinstance(value, dict) and depth:
        for key, item in value.items():
            yield from _text_fields(item, f"{prefix}{key}.", depth - 1)
    elif isinstance(value, str) and prefix:
        yield prefix[:-1], value


def scoring_fields(reward: Scorer, rows: Sequence[PromptRow]) -> list[str]:
    """The row fields (dotted paths; at most :data:`FIELDS_TRIED`, on :data:`FIELD_ROWS` rows: a reward may run
    code) whose text scores above 0 under ``reward`` for some of ``rows``."""
    rows = rows[:FIELD_ROWS]
    paths = list(dict.fromkeys(path for row in rows for path, _ in _text_fields(row.columns or {})))[
        :FIELDS_TRIED
    ]
    found = []
    for path in paths:
        texts = [dict(_text_fields(row.columns or {})).get(path, "") for row in rows]
        if any(out.score > 0 for out in reward.score(_inputs(rows, texts))):
            found.append(path)
    return found


def check_sft_targets(reward: Scorer, rows: Sequence[PromptRow], *, response_key: str | None) -> str | None:
    """Score the first :data:`TARGETS_SCORED` SFT targets; the warning (also logged) when none scores above the
    lowest score, else None."""
    sample = list(rows[:TARGETS_SCORED])
    if not sample:
        return None
    try:
        scores = [out.score for out in reward.score(_inputs(sample, [sft_target(row) for row in sample]))]
        if max(scores) > min(scores) or max(scores) > 0:
            return None
        fields = scoring_fields(reward, sample)
    finally:
        reward.take_step_metrics()  # the first RL step's reward/error_frac and error budget start from zero
    where = f"data.response_key={response_key!r}" if response_key else "the label (no data.response_key)"
    hint = (
        f"these row fields do score: {', '.join(fields)} – set data.response_key to one"
        if fields
        else "give the SFT targets the answer format the reward expects (data.response_key), or check the reward"
    )
    message = (
        f"none of the first {len(sample)} SFT targets ({where}; e.g. {sft_target(sample[0])!r:.60}) scores "
        f"above {max(scores):g} under algorithm.reward {reward.name!r}: the warm start teaches a format the "
        f"reward never rewards, so RL starts with no reward signal; {hint}"
    )
    logger.warning(message)
    return message


def dry_run_sft_check(cfg: Any, rows: Sequence[Any]) -> str:
    """``train --dry-run``'s line about the SFT targets: :func:`check_sft_targets` under the run's reward (inline,
    a few targets) before any SFT step is spent on a format the reward never rewards."""
    if cfg.sft.steps <= 0:
        return "sft targets: no warm start (sft.steps 0)"
    from sapo_megatron.data.thinking import reward_after_thinking
    from sapo_megatron.rewards.runner import build_reward_runner

    algorithm, data = cfg.algorithm, cfg.data
    with build_reward_runner(
        algorithm.reward,
        workers=0,
        timeout_s=algorithm.reward_timeout_s,
        kwargs=algorithm.reward_kwargs,
        after_thinking=reward_after_thinking(
            algorithm.reward_after_thinking, data.tokenizer, data.chat_template_kwargs
        ),
    ) as reward:
        warning = check_sft_targets(reward, rows, response_key=data.response_key)
    return f"warning: {warning}" if warning else "sft targets OK: they score under algorithm.reward"


def dry_run_warm_start(cfg: Any, data: Any) -> list[str]:
    """``train --dry-run``'s lines about the warm start: the targets under the reward, their lengths against the
    model's context (one line refuses them, as train does before SFT), multi-turn: the first tool call against
    ``rollout.max_new_tokens``."""
    from sapo_megatron.rollout.episodes.warm_start import check_sft_lengths, sft_settings

    lines = [dry_run_sft_check(cfg, data.train_rows)]
    if cfg.sft.steps > 0:
        lines.append(check_sft_lengths(data.renderer, data.train_rows, **sft_settings(cfg)))
    if cfg.rollout.multi_turn is not None:
        from sapo_megatron.rollout.episodes.warm_start import first_turn_length

        first_turn = first_turn_length(data.renderer, **sft_settings(cfg))
        cut = check_first_tool_call(data.train_rows, data.tokenizer, cfg.rollout.max_new_tokens, first_turn)
        lines.append(
            f"warning: {cut}"
            if cut
            else "tool calls OK: the SFT targets' first tool call fits max_new_tokens"
        )
    return lines


def check_first_tool_call(
    rows: Sequence[Any],
    tokenizer: Any,
    max_new_tokens: int,
    first_turn: Callable[[Any], int] | None = None,
) -> str | None:
    """Multi-turn warm starts: the longest first turn of the first :data:`TARGETS_SCORED` SFT targets that call
    a tool (the target up to its first ``</tool_call>``), in tokens; a warning (the dry run prints it) when
    ``rollout.max_new_tokens`` would cut it, so every such turn would end truncated before the tool runs.
    ``first_turn``: a messages-form row's first turn in tokens as SFT trains it (the template's think block and
    end of turn included); without it, the turn's call as Qwen's templates write it."""
    end = "</tool_call>"
    sample = rows[:TARGETS_SCORED]
    targets = [
        first_turn_call(row.response) if is_conversation(row.response) else sft_target(row) for row in sample
    ]
    calling = [(row, t) for row, t in zip(sample, targets) if "<tool_call>" in t and end in t]
    if not calling:
        return None
    longest = max(
        first_turn(row)
        if first_turn is not None and is_conversation(row.response)
        else len(tokenizer.encode(text[: text.index(end) + len(end)]))
        for row, text in calling
    )
    if longest <= max_new_tokens:
        return None
    message = (
        f"the SFT targets' first turn takes up to {longest} tokens with its tool call, and rollout.max_new_tokens="
        f"{max_new_tokens} cuts every such turn before the tool runs: raise rollout.max_new_tokens (a turn's budget)"
    )
    return message


class NoSignalWatch:
    """Counts RL steps in a row whose groups all had equal rewards; warns once after :data:`PATIENCE`."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.in_a_row = 0
        self.warned = False

    def observe(self, step: int, metrics: dict[str, float]) -> str | None:
        """Record one RL step's metrics; the warning (also logged) the first time it is due, else None."""
        spread = metrics.get("reward/group_std_mean")
        if spread is None:  # a step without rollout metrics (should not happen): no evidence either way
            return None
        self.in_a_row = self.in_a_row + 1 if spread == 0 else 0
        if self.warned or self.in_a_row < PATIENCE:
            return None
        self.warned = True
        message = self.message(step, metrics)
        logger.warning(message)
        return message

    def message(self, step: int, metrics: dict[str, float]) -> str:
        mean, truncated = metrics.get("reward/mean", 0.0), metrics.get("response/truncated_frac", 0.0)
        causes = [
            "the SFT target's format against the reward's (data.response_key; e.g. verl GSM8K rewards want "
            "'#### 72', the label alone is '72')",
            "the answer key (data.label_key: does the label hold what the reward compares with?)",
            f"rollout.max_new_tokens={self.cfg.rollout.max_new_tokens} too short ({truncated:.0%} of the last "
            "step's responses were cut at it)",
        ]
        if mean > 0:
            causes.insert(0, "a task the policy already solves every time (every sample scored the same)")
        return (
            f"no reward signal: in the last {self.in_a_row} RL steps (to step {step}) every group's rewards were "
            f"equal (reward mean {mean:g}), so every advantage is 0 and the policy does not change. Likely causes: "
            + "; ".join(causes)
        )
