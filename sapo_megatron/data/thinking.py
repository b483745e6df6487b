"""Qwen3's thinking blocks in a response: ``<think>\\n…\\n</think>\\n\\n`` before the answer.

:func:`split_thinking` splits a whole response as SGLang's ``qwen3`` reasoning parser does
(``srt/parser/reasoning_parser.py``, ``Qwen3Detector.detect_and_parse``, ``force_reasoning`` off): a response
without ``<think>`` is all answer (thinking off: the template's generation prompt already closed an empty block);
otherwise the reasoning runs from the opening tag(s) to the first ``</think>``, and the answer is what follows. A
response cut before ``</think>`` is all reasoning, unless a ``<tool_call>`` interrupts it (Qwen3.5 opens calls
without closing the block; SGLang then lets the call start the answer).

Rewards (``algorithm.reward_after_thinking``), tool-call parsing and eval's thinking share use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START = "<tool_call>"


def split_thinking(text: str) -> tuple[str, str]:
    """``(reasoning, answer)`` of a response's text (special tokens such as ``<|im_end|>`` already dropped)."""
    if THINK_START not in text:
        return "", text
    body = text
    while body.startswith(THINK_START):
        body = body[len(THINK_START) :]
    if THINK_END in body:
        reasoning, answer = body.split(THINK_END, 1)
        return reasoning, answer
    tool = body.find(TOOL_START)
    if tool >= 0:
        return body[:tool], body[tool:]
    return body, ""


def thinking_enabled(tokenizer: str, template_kwargs: Mapping[str, Any]) -> bool:
    """Whether responses think by default: ``data.tokenizer: qwen3`` without ``enable_thinking: false``."""
    return tokenizer == "qwen3" and template_kwargs.get("enable_thinking", True) is not False


def reward_after_thinking(setting: bool | None, tokenizer: str, template_kwargs: Mapping[str, Any]) -> bool:
    """``algorithm.reward_after_thinking``: as set, else (``None``) :func:`thinking_enabled`."""
    return thinking_enabled(tokenizer, template_kwargs) if setting is None else setting


def thinking_tokens(
    response_ids: Sequence[int], think_start: int, think_end: int, loss_mask: Sequence[int] | None = None
) -> int:
    """How many of a response's sampled tokens think: those from a ``<think>`` to its ``</think>``, both
    included (to the end when a turn is cut before closing it). ``loss_mask`` (episodes): only mask-1 tokens
    count, so the empty blocks that thinking-off deltas carry (mask 0) are no thinking."""
    count, inside = 0, False
    for position, token in enumerate(response_ids):
        sampled = loss_mask is None or loss_mask[position] == 1
        inside = inside or (token == think_start and sampled)
        count += inside and sampled
        inside = inside and token != think_end
    return count
