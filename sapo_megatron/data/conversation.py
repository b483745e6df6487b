"""Messages-form SFT targets: a tool-use warm start written as the conversation the policy should hold.

A row's ``response`` (``data.response_key``) may be a list of messages instead of one string: the assistant turns
(``content``, optionally ``reasoning_content`` and structured ``tool_calls``) and the tool results between them
(``role: tool``), first and last an assistant turn – an episode always ends on an engine turn. SFT then trains on
the assistant turns only; the tool results are context (loss mask 0), as in a multi-turn episode
(:mod:`sapo_megatron.rollout.episodes.warm_start` builds the ids).

This module checks the form when the data is read and gives the texts the start-up checks need: the final answer
(what the reward scores) and the first turn's tool call (what ``rollout.max_new_tokens`` must hold).
"""

from __future__ import annotations

import json
from typing import Any

from sapo_megatron.data.prompts import DatasetError

Conversation = list[dict[str, Any]]
ROLES = ("assistant", "tool")
_ASSISTANT_KEYS = ("role", "content", "reasoning_content", "tool_calls")
_TOOL_KEYS = ("role", "content", "name", "tool_call_id")


def is_conversation(response: Any) -> bool:
    """True for a messages-form target (a list), False for a string target or none."""
    return isinstance(response, list)


def check_conversation(value: Any, where: str, key: str) -> Conversation:
    """``value`` as a messages-form target, each message reduced to the keys the chat template reads; one
    :class:`DatasetError` line naming the message and what is wrong otherwise."""
    if not value:
        raise DatasetError(f"{where}: field {key!r} (the response) is an empty list of messages")
    messages = []
    for index, message in enumerate(value):
        name = f"{where}: field {key!r} message {index}"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DatasetError(
                f"{name} must be an object with role 'assistant' or 'tool', got {message!r:.80}",
                hint="a messages-form target holds the assistant turns and the tool results between them; the "
                "prompt holds the system and user messages",
            )
        if not isinstance(message.get("content", ""), str):
            raise DatasetError(f"{name}: 'content' must be a string, got {type(message['content']).__name__}")
        keys = _ASSISTANT_KEYS if message["role"] == "assistant" else _TOOL_KEYS
        messages.append(
            {k: message[k] for k in keys if k in message} | {"content": message.get("content", "")}
        )
        if message["role"] == "assistant":
            _check_tool_calls(message.get("tool_calls"), name)
    for index in range(1, len(messages)):
        if messages[index]["role"] == messages[index - 1]["role"] == "assistant":
            raise DatasetError(
                f"{where}: field {key!r}: assistant message {index} follows an assistant message: an episode goes "
                "on after a turn only with its tool results",
                hint="put the tool messages of the turn before it between them, or merge the two turns",
            )
    if messages[0]["role"] != "assistant" or messages[-1]["role"] != "assistant":
        raise DatasetError(
            f"{where}: field {key!r}: a messages-form target starts and ends with an assistant message (got "
            f"{messages[0]['role']} ... {messages[-1]['role']})",
            hint="the tool results go between assistant turns; the last turn is the model's answer",
        )
    return messages


def _check_tool_calls(calls: Any, name: str) -> None:
    if calls is None:
        return
    if not isinstance(calls, list):
        raise DatasetError(f"{name}: 'tool_calls' must be a list, got {type(calls).__name__}")
    for j, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise DatasetError(
                f"{name}: tool_calls[{j}] must be {{'function': {{'name': ..., 'arguments': {{...}}}}}}, got "
                f"{call!r:.80}"
            )


def final_answer(conversation: Conversation) -> str:
    """The last assistant message's content: what the reward scores at the end of an episode."""
    return str(conversation[-1].get("content", ""))


def first_turn_call(conversation: Conversation) -> str:
    """The first assistant turn's text up to its tool call, as Qwen's templates write it (content, then each call
    as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``); the content alone when it calls none."""
    first = conversation[0]
    text = first.get("content", "")
    for call in first.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments) if arguments.strip() else {}
        body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
        text += f"\n<tool_call>\n{body}\n</tool_call>"
    return text
