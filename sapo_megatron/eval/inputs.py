"""What evaluation takes from the data and reward packages, in one place: an eval dataset's rows, the prompt
ids the engine receives, and a sample's score and extracted answer.

Rows: :func:`~sapo_megatron.data.datasets.load_dataset` with the dataset's keys (verl / slime / plain layouts),
or a ``synthetic:`` task's held-out split; every row checked and the prompt-length policy applied as for training
(:func:`~sapo_megatron.data.render.apply_length_policy`). Prompt ids: :class:`~sapo_megatron.data.render.
PromptRenderer` (chat template, ``prompt_template``), so the engine receives what it receives in training.
Scores: the reward runner (:func:`~sapo_megatron.rewards.runner.build_reward_runner`, one batch per call through
:func:`~sapo_megatron.rewards.samples.score_sample_groups`); the answer majority voting counts is the reward's
``answer`` field, else the reward's own extraction rule (:mod:`sapo_megatron.rewards.answers`) for the rewards that
compare one; other rewards give no answer (no maj@n).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from sapo_megatron.data.datasets import load_dataset
from sapo_megatron.data.prompts import PromptRow, check_encodable
from sapo_megatron.data.render import PromptRenderer, apply_length_policy
from sapo_megatron.data.thinking import split_thinking
from sapo_megatron.data.vision import VisionSpec
from sapo_megatron.eval.config import SYNTHETIC_SIZE, EvalDataset
from sapo_megatron.rewards.answers import extract_final_answer, extract_last_number
from sapo_megatron.rollout.types import ImageInputs


def load_eval_rows(
    dataset: EvalDataset, *, digits: int, seed: int, vision: VisionSpec | None = None
) -> list[PromptRow]:
    """The dataset's prompt rows: a ``synthetic:`` task's held-out split (``size`` of them, default
    :data:`SYNTHETIC_SIZE`), or a file's (directory's, glob's) first ``size`` rows (all by default); ``vision``
    sizes the rows' images as for training (None: a row with images is refused)."""
    from sapo_megatron.data.synthetic import TASKS, make_mixed_rows
    from sapo_megatron.errors import ConfigError

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
    keys = dataset.keys
    policy = (
        None if vision is None else keys.image_policy(vision.factor, vision.min_pixels, vision.max_pixels)
    )
    rows = load_dataset(dataset.path, keys, policy)
    return rows[: dataset.size] if dataset.size else rows


class EvalPrompts:
    """The prompts of one eval dataset as the engine receives them (the training renderer, with the dataset's
    keys)."""

    def __init__(
        self,
        tokenizer: Any,
        dataset: EvalDataset,
        tools: list[dict[str, Any]] | None = None,
        vision: VisionSpec | None = None,
    ) -> None:
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.renderer = PromptRenderer(tokenizer, dataset.keys, vision, tools=tools)

    def check(self, rows: list[PromptRow], *, context: int | None) -> list[PromptRow]:
        """Refuse a row the tokenizer cannot encode (naming file and line), then apply the length policy
        (``context``: the model's positions, leaving room for the dataset's ``max_new_tokens``)."""
        keys, dataset = self.dataset.keys, self.dataset
        check_encodable(rows, self.tokenizer, dataset.path, template=keys.prompt_template)
        limit = None if context is None else context - dataset.max_new_tokens
        if limit is not None and limit < 1:
            from sapo_megatron.errors import ConfigError

            raise ConfigError(
                f"eval dataset {dataset.name}: max_new_tokens={dataset.max_new_tokens} leaves no room for a prompt "
                f"in the model's context (max_position_embeddings={context})",
                hint="set the dataset's max_new_tokens (or eval.defaults.max_new_tokens) lower",
            )
        reason = (
            None
            if limit is None
            else f"the model's context for a prompt: max_position_embeddings={context} - the eval dataset's "
            f"max_new_tokens={dataset.max_new_tokens}"
        )
        kept, _ = apply_length_policy(
            rows, self.renderer, keys, dataset.path, limit=limit, limit_reason=reason
        )
        return kept

    def encode(self, row: PromptRow) -> list[int]:
        return self.renderer.encode(row)

    def images(self, row: PromptRow) -> ImageInputs | None:
        """The row's images as the rollout sends them (PNG bytes; the engine expands the pads)."""
        if not row.images:
            return None
        vision = self.renderer.vision
        if vision is None:  # loading refuses image rows for a text-only model (check_model_takes_images)
            raise ValueError("a row with images, and the model takes none")
        return ImageInputs(png=tuple(image.png() for image in row.images), pad_id=vision.pad_id)

    def text(self, row: PromptRow) -> str:
        """The prompt as rendered for the model (chat template included)."""
        return self.renderer.text(row)


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
    """Scores one eval dataset's samples with its reward through the reward runner (inline, a worker pool or a
    server, as ``algorithm.reward_workers`` says), counted apart from the training reward so that evaluation
    never spends a training step's error budget. The answer is the reward's ``answer`` field when it returns one
    (math_verify, dapo_math), else the extraction of :data:`ANSWER_RULES`."""

    def __init__(self, spec: Any, *, field: str, algorithm: Any, after_thinking: bool = False) -> None:
        from sapo_megatron.rewards.runner import build_reward_runner

        same = spec is algorithm.reward or spec == algorithm.reward  # the training reward keeps its kwargs
        self.runner = build_reward_runner(
            spec,
            workers=algorithm.reward_workers,
            timeout_s=algorithm.reward_timeout_s,
            kwargs=algorithm.reward_kwargs if same else None,
            name=f"{spec} (evaluation)",
            field=field,
            after_thinking=after_thinking,
        )
        self._answer = ANSWER_RULES.get(spec) if isinstance(spec, str) else None

    def score_groups(
        self, groups: Sequence[Sequence[Any]], rows: Sequence[PromptRow], decode
    ) -> list[list[Scored]]:
        """``[prompt][sample]`` scores and answers of generated groups, in one runner call."""
        from sapo_megatron.rewards.samples import score_sample_groups

        scores = score_sample_groups(self.runner, groups, rows, decode)
        return [
            [Scored(score, self._answer_of(sample, decode)) for score, sample in zip(group_scores, group)]
            for group_scores, group in zip(scores, groups)
        ]

    def _answer_of(self, sample: Any, decode) -> str | None:
        answer = sample.reward_fields.get("answer")
        if answer is None and self._answer is not None:
            text = decode(list(sample.response_ids))
            answer = self._answer(split_thinking(text)[1] if self.runner.after_thinking else text)
        return None if answer in (None, "") else str(answer)

    def check_errors(self, max_frac: float, dataset: str) -> None:
        """Raise :class:`~sapo_megatron.rewards.registry.RewardError` naming ``dataset`` when more than
        ``max_frac`` of the samples since the last check failed (``algorithm.max_reward_error_frac``, as in
        training); then start counting again."""
        from sapo_megatron.rewards.registry import RewardError

        try:
            self.runner.check_error_budget(max_frac)
        except RewardError as err:
            raise RewardError(f"eval dataset {dataset}: {err}", hint=err.hint) from None
        self.runner.take_step_metrics()

    def close(self) -> None:
        self.runner.close()
