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
