"""Tool observations as chat-template deltas of the model's own template, tokenized on their own.

An episode's token ids are never re-tokenized: the engine's output ids are kept as they are, and what comes
between two turns – the end of the assistant turn, the tool messages, the next assistant header – is the text
the template adds for those messages, encoded alone and appended. verl renders the tool messages after a fixed
dummy conversation and keeps the difference; so do we, with one more piece that verl learnt the hard way (its
issue #3720): the engine stops *at* the end-of-turn token, and Qwen's template writes ``<|im_end|>\\n``, so the
``\\n`` (whatever the template puts after the end-of-turn token) belongs to the delta.

With Qwen's templates the result equals ``apply_chat_template`` of the whole conversation, tokenized at once,
because every delta starts right after a special token (tests/rollout/episodes check it on the shipped BPE).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sapo_megatron.errors import UserError

Message = Mapping[str, Any]

_DUMMY = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
_DUMMY_REPLY = {"role": "assistant", "content": "A"}


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
        before = self._render([*_DUMMY, _DUMMY_REPLY], add_generation_prompt=False)
        cut = before.rfind(end_of_turn)
        if cut < 0:
            raise TemplateDeltaError(
                f"the chat template does not end an assistant turn with {end_of_turn!r}",
                hint="set rollout.multi_turn.end_of_turn to the token the template closes a turn with",
            )
        self._before = before
        self._after_end = before[cut + len(end_of_turn) :]  # Qwen: "\n"

    def text(self, messages: Sequence[Message]) -> str:
        """The delta as text: what follows the end-of-turn token, the messages, and the generation prompt."""
        after = self._render([*_DUMMY, _DUMMY_REPLY, *messages], add_generation_prompt=True)
        if not after.startswith(self._before):
            raise TemplateDeltaError(
                "the chat template rewrites earlier turns when tool messages follow (the rendering of the "
                "conversation before them is not a prefix of the rendering after): observations cannot be "
                "appended as a delta"
            )
        return self._after_end + after[len(self._before) :]

    def ids(self, messages: Sequence[Message]) -> list[int]:
        return list(self.hf(self.text(messages), add_special_tokens=False)["input_ids"])

    def _render(self, messages: list, *, add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
        )
