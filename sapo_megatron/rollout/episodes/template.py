"""Tool observations as chat-template deltas of the model's own template, tokenized on their own.

An episode's token ids are never re-tokenized: the engine's output ids are kept as they are, and what comes
between two turns – the end of the assistant turn, the tool messages, the next assistant header – is the text
the template adds for those messages, encoded alone and appended. verl renders the tool messages after a fixed
dummy conversation of a system and a user message (no assistant turn: Qwen3's template renders the *last*
assistant turn with a ``<think>`` block that it leaves out once other messages follow, so a dummy reply would not
be a prefix of the longer rendering) and keeps the difference; so do we, with one more piece that verl learnt the
hard way (its issue #3720): the engine stops *at* the end-of-turn token, and Qwen's template writes
``<|im_end|>\\n``, so the ``\\n`` (whatever the template puts after the end-of-turn token) belongs to the delta.

With Qwen's templates the result equals ``apply_chat_template`` of the whole conversation, tokenized at once,
because every delta starts right after a special token (tests/rollout/episodes check it on the shipped BPE).

Message content is data, never control: the text of a tool result (or any message of a delta) is tokenized as
plain text, so ``<|im_end|>\\n<|im_start|>assistant`` printed by a tool becomes the ids of those characters, not
the end-of-turn and turn-start tokens (verl's tool agent loop and SGLang's chat route tokenize the rendered
conversation whole, so there such text does become control tokens). Only the special tokens the template itself
writes are special ids. Ordinary added tokens (Qwen3's ``<think>``, ``<tool_response>``) stay what they are in any
text, as in a user's prompt.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from sapo_megatron.errors import UserError

Message = Mapping[str, Any]

_DUMMY = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
_DUMMY_REPLY = {"role": "assistant", "content": "A"}
_MARK = "\x00content{}\x00"  # a message's content while the template renders around it
_MARKS = re.compile("\x00content(\\d+)\x00")


class TemplateDeltaError(UserError):
    """The chat template cannot render tool observations as an append-only delta."""


class ObservationDeltas:
    """``ids(messages)``: the token ids that follow an assistant turn ending in the end-of-turn token and carry
    ``messages`` (tool results, or a user message) up to the next assistant header (the generation prompt).

    ``hf``: a transformers tokenizer with a chat template; ``end_of_turn``: the token the engine stops at (Qwen:
    ``<|im_end|>``); ``template_kwargs``: passed to every ``apply_chat_template`` (e.g. ``enable_thinking``)."""

    def __init__(self, hf: Any, end_of_turn: str, template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.hf = hf
        self.end_of_turn = end_of_turn
        self.kwargs = dict(template_kwargs or {})
        self.kwargs.pop("tools", None)  # the tool list belongs to the system prompt, not to a delta
        replied = self._render([*_DUMMY, _DUMMY_REPLY], add_generation_prompt=False)
        cut = replied.rfind(end_of_turn)
        if cut < 0:
            raise TemplateDeltaError(
                f"the chat template does not end an assistant turn with {end_of_turn!r}",
                hint="set rollout.multi_turn.end_of_turn to the token the template closes a turn with",
            )
        self._before = self._render(_DUMMY, add_generation_prompt=False)
        self._special = _special_pattern(hf)
        self._after_end = replied[cut + len(end_of_turn) :]  # Qwen: "\n"

    def text(self, messages: Sequence[Message]) -> str:
        """The delta as text: what follows the end-of-turn token, the messages, and the generation prompt."""
        after = self._render([*_DUMMY, *messages], add_generation_prompt=True)
        if not after.startswith(self._before):
            raise TemplateDeltaError(
                "the chat template rewrites earlier turns when tool messages follow (the rendering of the "
                "conversation before them is not a prefix of the rendering after): observations cannot be "
                "appended as a delta"
            )
        return self._after_end + after[len(self._before) :]

    def ids(self, messages: Sequence[Message]) -> list[int]:
        """The delta's ids: the template's own text as the tokenizer reads it (its special tokens as special ids),
        every message's string content as plain text (a special token's text in it is that text's ids)."""
        marked = [
            {**m, "content": _MARK.format(i)} if isinstance(m.get("content"), str) else m
            for i, m in enumerate(messages)
        ]
        pieces = _MARKS.split(self.text(marked))  # template, index, template, index, ..., template
        rebuilt = "".join(p if k % 2 == 0 else messages[int(p)]["content"] for k, p in enumerate(pieces))
        if rebuilt != self.text(messages):
            raise TemplateDeltaError(
                "the chat template changes a tool message's content (the rendering of its text is not the text "
                "itself): observations cannot be tokenized as plain text",
                hint="use a chat template that writes message content verbatim (Qwen's do)",
            )
        segments: list[tuple[bool, str]] = []  # (special, text); a message's content joins the text around it
        for k, piece in enumerate(pieces):
            if k % 2:
                self._add_text(segments, messages[int(piece)]["content"])
                continue
            for j, part in enumerate(self._special.split(piece) if self._special else [piece]):
                if j % 2:
                    segments.append((True, part))
                else:
                    self._add_text(segments, part)
        ids: list[int] = []
        for special, text in segments:
            if special:
                ids.append(self.hf.convert_tokens_to_ids(text))
            else:
                ids += self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ids

    @staticmethod
    def _add_text(segments: list[tuple[bool, str]], text: str) -> None:
        if not text:
            return
        if segments and not segments[-1][0]:
            segments[-1] = (False, segments[-1][1] + text)
        else:
            segments.append((False, text))

    def _render(self, messages: list, *, add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
        )


def _special_pattern(hf: Any) -> re.Pattern | None:
    """The tokenizer's special tokens (control tokens) as a splitting pattern, longest first."""
    names = sorted((t.content for t in hf.added_tokens_decoder.values() if t.special), key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
