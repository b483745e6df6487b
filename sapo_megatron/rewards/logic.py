"""The verifier of the knights-and-knaves puzzles (:mod:`sapo_megatron.data.logic_puzzles`), and ``mixed_tasks``:
one reward for the paper's mixed data, chosen by each row's source."""

from __future__ import annotations

from typing import Any

from sapo_megatron.data.logic_puzzles import SOURCE, parse_assignment
from sapo_megatron.rewards.answers import last_boxed


def knights_knaves(response: str, label: str) -> float:
    """1.0 when the response's final answer (``\\boxed{...}``, else its last line) gives every person of the label
    the label's kind and names no one else, else 0.0."""
    answer = last_boxed(response)
    if answer is None:
        lines = [line for line in response.splitlines() if line.strip()]
        answer = lines[-1] if lines else ""
    return 1.0 if parse_assignment(answer) == parse_assignment(label) else 0.0


VISUAL_NUMERIC = frozenset({"count_shapes", "read_digits", "geometry"})
WORD_ANSWERS = frozenset({"name_colour", "easy_vqa_yes_no", "easy_vqa_shape", "easy_vqa_colour"})


def mixed_tasks(response: str, label: str, source: str | None = None, metadata: Any = None) -> Any:
    """The paper's mixed coding / logic / math data in one reward, by each row's source: knights_knaves for the
    logic puzzles, exact_match for one-word visual answers, numeric_match for the visual tasks with numbers,
    code_exec for sources starting with ``code``, and math_verify (numeric_match where it is not installed)
    for the rest (math)."""
    from sapo_megatron.rewards.answers import exact_match, numeric_match
    from sapo_megatron.rewards.code_exec import code_exec
    from sapo_megatron.rewards.math_verify_reward import math_verify_available, math_verify_reward

    if source == SOURCE:
        return knights_knaves(response, label)
    if source in WORD_ANSWERS:
        return exact_match(response, label)
    if source in VISUAL_NUMERIC:
        return numeric_match(response, label)
    if source is not None and source.startswith("code"):
        return code_exec(response, label, metadata)
    return math_verify_reward(response, label) if math_verify_available() else numeric_match(response, label)
