"""What evaluation takes from the data and reward packages, in one place: an eval dataset's rows, the prompt
ids the engine receives, and a sample's score and extracted answer.

Written over today's reader (:func:`~sapo_megatron.data.prompts.load_prompts`, ``synthetic:`` tasks, the
``prompt_template`` encoding the trainer uses) and reward registry (:class:`~sapo_megatron.rewards.registry.
SafeReward`). The answer majority voting counts comes from the reward's own extraction rule
(:mod:`sapo_megatron.rewards.answers`) for the rewards that have one; other rewards give no answer (no maj@n).
When the dataset reader (``load_dataset`` / ``PromptRenderer``) and the reward runner (``RewardOutput.fields
["answer"]``) land, only this module changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from sapo_megatron.data.prompts import PromptRow, check_encodable, load_prompts
from sapo_megatron.eval.config import SYNTHETIC_SIZE, EvalDataset
from sapo_megatron.rewards.answers import extract_final_answer, extract_last_number


def load_eval_rows(dataset: EvalDataset, *, digits: int, seed: int) -> list[PromptRow]:
    """The dataset's prompt rows: a ``synthetic:`` task's held-out split (``size`` of them, default
    :data:`SYNTHETIC_SIZE`), or a file's first ``size`` rows (all by default)."""
    from sapo_megatron.config import ConfigError
    from sapo_megatron.data.synthetic import TASKS, make_mixed_rows

    if dataset.path.startswith("synthetic:"):
        tasks = dataset.path.removeprefix("synthetic:").split("+")
        unknown = [task for task in tasks if task not in TASKS]
        if unknown:
            raise ConfigError(
                f"eval dataset {dataset.name}: unknown synthetic task {unknown[0]!r} in {dataset.path!r}; the "
                f"tasks are {', '.join(TASKS)}, mixed with '+'"
            )
        return make_mixed_rows(
            tasks, dataset.size or SYNTHETIC_SIZE, digits=digits, split="heldout", seed=seed
        )
    rows = load_prompts(dataset.path)
    return rows[: dataset.size] if dataset.size else rows


def check_rows(rows: Sequence[PromptRow], tokenizer: Any, dataset: EvalDataset) -> None:
    """Refuse a row the tokenizer cannot encode, naming the file and line (before any model is built)."""
    check_encodable(rows, tokenizer, dataset.path, template=dataset.prompt_template)


def prompt_text(row: PromptRow, dataset: EvalDataset) -> str:
    """The prompt as rendered for the model."""
    return dataset.prompt_template.format(prompt=row.prompt)


def encode_prompt(tokenizer: Any, row: PromptRow, dataset: EvalDataset) -> list[int]:
    """The prompt ids the engine receives (the trainer's encoding: template, then BOS when the tokenizer has
    one)."""
    return tokenizer.encode(prompt_text(row, dataset), add_bos=tokenizer.bos_id is not None)


@dataclasses.dataclass(frozen=True)
class Scored:
    score: float
    answer: str | None


def _number_answer(response: str) -> str | None:
    answer = extract_final_answer(response)
    number = None if answer is None else extract_last_number(answer)
    if number is None:
        return None
    return str(int(number)) if number.is_integer() else repr(number)  # "46" and "46.0" vote together


ANSWER_RULES: dict[str, Callable[[str], str | None]] = {
    "exact_match": extract_final_answer,
    "numeric_match": _number_answer,
}
"""The answer each reward compares (its extraction), for majority voting."""


class EvalReward:
    """Scores responses of one eval dataset with its reward (counted apart from the training reward, so that
    evaluation never spends the training step's error budget)."""

    def __init__(self, name: str, *, field: str, dataset: str) -> None:
        from sapo_megatron.config import ConfigError
        from sapo_megatron.rewards.registry import SafeReward, check_reward_available, get_reward

        try:
            check_reward_available(name)
        except ConfigError as err:
            raise ConfigError(str(err).replace("algorithm.reward", field, 1)) from None
        self.reward = SafeReward(get_reward(name), f"{name} (eval dataset {dataset})")
        self._answer = ANSWER_RULES.get(name)

    def __call__(self, response: str, row: PromptRow) -> Scored:
        score = self.reward(response, row.ground_truth)
        return Scored(score, self._answer(response) if self._answer else None)

    def check_errors(self, max_frac: float) -> None:
        """Raise :class:`~sapo_megatron.rewards.registry.RewardError` when more than ``max_frac`` of the calls
        since the last check raised (``algorithm.max_reward_error_frac``, as in training); then start again."""
        self.reward.check_error_budget(max_frac)
        self.reward.take_step_metrics()
