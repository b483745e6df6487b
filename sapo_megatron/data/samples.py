"""``samples.jsonl``: what the policy said, every ``trainer.log_samples_every`` RL steps and at the last one (0:
never), so that a run shorter than the interval still writes some.

Each logged step writes the first sample of each of its first :data:`SAMPLES_PER_STEP` groups, one JSON object a
line: ``phase`` ("rl"), ``step``, ``prompt`` (the prompt ids the engine received, decoded with special tokens
kept, so a chat template shows as the model saw it), ``response``, ``reward`` and the reward's extra fields
(``answer``, ...), ``source``, ``finish_reason``, ``response_tokens``; for a multi-turn episode the response is
decoded with its special tokens (turn boundaries show as ``<|im_end|>`` / ``<|im_start|>user``), and
``loss_mask_spans`` lists the ``[start, end)`` token spans the policy sampled (the rest are observations); and
``images`` (each image's file path,
or ``bytes:<sha256 prefix>`` for an image held in the dataset) when the prompt has images. The first :data:`TENSORBOARD_SAMPLES` of them also go to
TensorBoard as text (tag ``samples``). A resumed run drops the rows after its checkpoint (:func:`resume_point`), as
``metrics.jsonl``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sapo_megatron import jsonio
from sapo_megatron.runtime.tracking import Tracker, truncate_metrics

SAMPLES_FILE = "samples.jsonl"
SAMPLES_PER_STEP = 4
TENSORBOARD_SAMPLES = 2


def resume_point(checkpoint: Any, *, batch_in_flight: bool = False) -> dict[str, int] | None:
    """The last step whose samples a run resumed from ``checkpoint`` keeps (``None``: a fresh start): the
    checkpoint's, or one more RL step when it holds the batch in flight (``batch_in_flight``: async rollout),
    whose samples were written and which the resumed run trains on without generating it again."""
    if checkpoint is None:
        return None
    steps = dict(checkpoint.steps)
    if batch_in_flight:
        steps["rl"] = steps.get("rl", 0) + 1
    return steps


class SampleLog:
    """Writes ``samples.jsonl`` in ``run_dir`` (main rank only: elsewhere every call does nothing)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        every: int,
        tokenizer: Any,
        enabled: bool,
        tracker: Tracker | None = None,
        resume_at: Mapping[str, int] | None = None,
        last_step: int | None = None,
    ) -> None:
        self.every = every
        self.last_step = last_step
        self.tokenizer = tokenizer
        self.tracker = tracker
        self.enabled = enabled and every > 0
        self.path = Path(run_dir) / SAMPLES_FILE
        self._lock = threading.Lock()  # the fully-async producer's chunks in flight record concurrently
        if enabled and resume_at is not None:
            truncate_metrics(self.path, resume_at)

    def due(self, step: int) -> bool:
        return self.enabled and (step % self.every == 0 or step == self.last_step)

    def record(self, step: int, batch: Any) -> list[dict[str, Any]]:
        """Write RL ``step``'s rows from a :class:`~sapo_megatron.rollout.collect.RolloutBatch` when due; returns
        them (empty when not due)."""
        if not self.due(step):
            return []
        rows = [
            self._row(step, batch, g, group[0])
            for g, group in enumerate(batch.groups[:SAMPLES_PER_STEP])
            if group
        ]
        with self._lock:
            with self.path.open("a") as handle:
                handle.writelines(jsonio.dumps(row, default=str) + "\n" for row in rows)
            if self.tracker is not None:
                for row in rows[:TENSORBOARD_SAMPLES]:
                    self.tracker.text("rl", "samples", _as_markdown(row), step)
                self.tracker.samples(step, rows)
        return rows

    def _row(self, step: int, batch: Any, group_index: int, sample: Any) -> dict[str, Any]:
        decode = self.tokenizer.decode
        prompt = batch.prompts[group_index]
        row = {
            "phase": "rl",
            "step": step,
            "prompt": decode(sample.prompt_ids, skip_special_tokens=False),
            "response": decode(sample.response_ids, skip_special_tokens=sample.loss_mask is None),
            "reward": float(batch.rewards[group_index, 0]),
            "source": prompt.domain,
            "finish_reason": sample.finish_reason,
            # episodes: the policy's tokens, not the observations; a masked cut response: all it generated
            "response_tokens": sample.generated_tokens if sample.episode else len(sample.response_ids),
        }
        episode = getattr(sample, "episode", None)
        if episode is not None:
            row.update(
                status=episode.status,
                turns=episode.turns,
                tool_calls=episode.tool_calls,
                tool_errors=episode.tool_errors,
                observation_tokens=len(sample.response_ids) - sample.generated_tokens,
            )
        if sample.loss_mask is not None:
            row["loss_mask_spans"] = _spans(sample.loss_mask)
        if prompt.images:  # which images the prompt showed (file path, or the digest of inline bytes)
            row["images"] = [image.name() for image in prompt.images]
        fields = getattr(sample, "reward_fields", None) or {}  # the reward's extra fields (e.g. answer)
        row.update({name: value for name, value in fields.items() if name not in row})
        return row


def _spans(mask: list[int]) -> list[list[int]]:
    """``[start, end)`` of each run of 1s in ``mask``."""
    spans: list[list[int]] = []
    for position, bit in enumerate(mask):
        if bit and spans and spans[-1][1] == position:
            spans[-1][1] = position + 1
        elif bit:
            spans.append([position, position + 1])
    return spans


def _as_markdown(row: Mapping[str, Any]) -> str:
    """A sample as TensorBoard shows text: markdown, the prompt and response in code blocks."""
    return (
        f"**reward {row['reward']:.3g}**, source {row['source']}, {row['finish_reason']}, "
        f"{row['response_tokens']} tokens\n\n```\n{row['prompt']}\n```\n\n```\n{row['response']}\n```"
    )
