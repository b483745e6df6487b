"""Tool calls in Qwen 2.5 / Qwen3's format (verl's ``format: hermes``)::

    <tool_call>
    {"name": "python", "arguments": {"code": "print(1 + 1)"}}
    </tool_call>

Parsed as SGLang's ``qwen25`` detector parses a whole text (``srt/function_call/qwen25_detector.py``,
``detect_and_parse``; tests/sglang_real compares the two on ``POST /parse_function_call``): the normal text is what
precedes the first ``<tool_call>\\n``, stripped; each ``<tool_call>\\n…\\n</tool_call>`` block holds one JSON object
with ``name`` and ``arguments`` (or ``parameters``). Where SGLang drops a block silently (bad JSON, a name it does
not know), training needs to tell the model: such a block becomes a :class:`ToolCall` with ``error`` set, whose
observation is that error.

A thinking block comes off first, as SGLang's ``qwen3`` reasoning parser takes it off before the tool parser sees
the text (:func:`~sapo_megatron.data.thinking.split_thinking`): a ``<tool_call>`` the model writes while it thinks
is no call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from sapo_megatron.data.thinking import split_thinking

BEGIN, END = "<tool_call>\n", "\n</tool_call>"
_BLOCK = re.compile(rf"{re.escape(BEGIN)}(.*?){re.escape(END)}", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's ``name`` and its ``arguments``; ``error`` when the block could not be read."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """``(normal_text, calls)`` of a model turn's text (special tokens kept or not: they are not part of it);
    ``normal_text`` is the answer's, after any thinking block."""
    _, text = split_thinking(text)
    start = text.find(BEGIN)
    if start < 0:
        return text, []
    return text[:start].strip(), [_call(block) for block in _BLOCK.findall(text)]


def _call(block: str) -> ToolCall:
    try:
        payload = json.loads(block.strip())
    except json.JSONDecodeError as error:
        return ToolCall("", error=f"the tool call is not valid JSON ({error.msg} at char {error.pos})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return ToolCall("", error='a tool call must be a JSON object with a "name" and "arguments"')
    arguments = payload.get("parameters") or payload.get("arguments") or {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(payload["name"], error="the tool call's arguments are not a JSON object")
    if not isinstance(arguments, dict):
        return ToolCall(payload["name"], error="the tool call's arguments are not a JSON object")
    return ToolCall(payload["name"], arguments)
