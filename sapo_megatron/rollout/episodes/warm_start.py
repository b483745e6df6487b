"""The token ids of a messages-form SFT target, built as an episode builds its ids.

A tool-use warm start should teach exactly the sequences RL episodes then produce. So the conversation is not
rendered whole and re-tokenized; it is appended turn by turn, as :class:`~sapo_megatron.rollout.episodes.episode.
Ledger` appends an episode:

- the prompt: the prompt's ids as the engine receives them (system turn with the tool schemas, generation prompt);
- each assistant turn (loss mask 1): what the chat template writes for that message as the *last* assistant turn
  after the generation prompt, up to and including the end-of-turn token (``<|im_end|>``, where the engine stops).
  With Qwen3's template and thinking on that is ``<think>\\n…\\n</think>\\n\\n`` + content (the empty block when the
  message has no reasoning: what the policy writes after ``<|im_start|>assistant\\n``); thinking off, the
  generation prompt holds the empty block and the turn is the content alone;
- the tool results after a turn (loss mask 0): :class:`~sapo_megatron.rollout.episodes.template.ObservationDeltas`
  of those messages, the same ids an episode appends (the ``\\n`` after the end-of-turn token, the ``<tool_response>``
  user turn, the next assistant header).

Qwen3's template drops the reasoning of assistant turns before the last *user* query only; the turns of a target
all follow it (tool results are no query), so when every turn carries its reasoning, or thinking is off, the ids
equal ``apply_chat_template`` of the whole conversation tokenized at once (tests/rollout/episodes/
test_warm_start.py, on the real Qwen3 tokenizer). A turn without reasoning under thinking on keeps its empty
``<think>`` block here, which the whole rendering leaves out for all but the last turn: training sees what the
policy writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sapo_megatron.data.conversation import Conversation, is_conversation
from sapo_megatron.data.prompts import DatasetError, PromptRow
from sapo_megatron.data.render import PromptRenderer
from sapo_megatron.model.batching import TrainSequence
from sapo_megatron.rollout.episodes.template import ObservationDeltas


class ConversationTargets:
    """``ids(row)``: ``(prompt ids, response ids, response mask)`` of a row with a messages-form ``response``."""

    def __init__(
        self, renderer: PromptRenderer, end_of_turn: str | None, template_kwargs: dict[str, Any]
    ) -> None:
        if renderer.hf is None:
            raise DatasetError(
                "a messages-form SFT target (a list of assistant and tool messages) needs a chat template",
                hint="set data.apply_chat_template: true with a chat tokenizer (data.tokenizer: qwen3 or chat)",
            )
        self.renderer = renderer
        self.hf = renderer.hf
        self.end_of_turn = end_of_turn or self.hf.eos_token
        self.deltas = ObservationDeltas(self.hf, self.end_of_turn, template_kwargs)
        self._end_id = self.hf.convert_tokens_to_ids(self.end_of_turn)

    def ids(self, row: PromptRow) -> tuple[list[int], list[int], list[int]]:
        """The prompt's ids, then the conversation's ids after it with one 0/1 per id (1: an assistant turn's)."""
        if not is_conversation(row.response):
            raise ValueError("ConversationTargets.ids takes rows whose response is a list of messages")
        conversation: Conversation = row.response  # type: ignore[assignment]
        prompt_ids = self.renderer.encode(row)
        history = self.renderer.messages(row)
        response: list[int] = []
        mask: list[int] = []
        index = 0
        while index < len(conversation):
            turn = conversation[index]
            turn_ids = self._turn(history, turn, index)
            response += turn_ids
            mask += [1] * len(turn_ids)
            history.append(turn)
            index += 1
            tools: Conversation = []
            while index < len(conversation) and conversation[index]["role"] == "tool":
                tools.append(conversation[index])
                index += 1
            if tools:
                observation = self.deltas.ids(tools)
                response += observation
                mask += [0] * len(observation)
                history += tools
        return prompt_ids, response, mask

    def _turn(self, history: list[dict[str, Any]], turn: dict[str, Any], index: int) -> list[int]:
        """The assistant message's ids as the policy writes them after the generation prompt."""
        before = self.renderer.render(history, add_generation_prompt=True)
        after = self.renderer.render([*history, turn], add_generation_prompt=False)
        if not after.startswith(before):
            raise DatasetError(
                f"the chat template renders assistant message {index} of the SFT target so that it does not follow "
                "its own generation prompt (e.g. a <think> block in the target with thinking off): the policy "
                "could never write it",
                hint="drop the reasoning from the target, or turn thinking on (data.chat_template_kwargs)",
            )
        text = after[len(before) :]
        missing = [name for name in _call_names(turn) if name not in text]
        if missing:
            raise DatasetError(
                f"the chat template drops the tool_calls of assistant message {index} of the SFT target (it renders "
                f"no {missing[0]!r}): SFT would teach a turn without its call",
                hint="use a template that renders tool calls (data.tokenizer: qwen3), or write the call into the "
                "message's content in the template's format (<tool_call>\n{...}\n</tool_call>)",
            )
        cut = text.find(self.end_of_turn)
        if cut < 0:
            raise DatasetError(
                f"the chat template does not end assistant message {index} of the SFT target with "
                f"{self.end_of_turn!r}",
                hint="set rollout.multi_turn.end_of_turn to the token the template closes a turn with",
            )
        return self.hf(text[: cut + len(self.end_of_turn)], add_special_tokens=False)["input_ids"]


def _call_names(turn: dict[str, Any]) -> list[str]:
    return [call.get("function", call).get("name", "") for call in turn.get("tool_calls") or []]


def sft_sequences(
    renderer: PromptRenderer,
    rows: list[PromptRow],
    *,
    end_of_turn: str | None,
    template_kwargs: dict[str, Any],
) -> list[TrainSequence]:
    """The supervised sequences of ``rows``: a string target trains on the whole target (``renderer.sft_ids``), a
    messages-form target on its assistant turns only; each with the prompt's images."""
    targets = None
    if any(is_conversation(row.response) for row in rows):
        targets = ConversationTargets(renderer, end_of_turn, template_kwargs)
    sequences = []
    for row in rows:
        images = renderer.image_inputs(row)
        if targets is not None and is_conversation(row.response):
            prompt, response, mask = targets.ids(row)
            sequences.append(TrainSequence(prompt, response, response_mask=mask, images=images))
        else:
            sequences.append(TrainSequence(*renderer.sft_ids(row), images=images))
    return sequences


SFT_ROWS_MEASURED = 4096
"""Rows whose SFT sequences :func:`check_sft_lengths` measures (the first: a bounded start-up check)."""


def check_sft_lengths(
    renderer: PromptRenderer,
    rows: list[PromptRow],
    *,
    context: int,
    end_of_turn: str | None,
    template_kwargs: dict[str, Any],
) -> str:
    """Refuse, in one line, SFT sequences (prompt + target, a conversation's tool results included) longer than
    the model's ``context`` (``max_position_embeddings``) before the warm start trains past it; else the line
    the dry run prints."""
    sample = rows[:SFT_ROWS_MEASURED]
    targets = None
    if any(is_conversation(row.response) for row in sample):
        targets = ConversationTargets(renderer, end_of_turn, template_kwargs)
    longest, where = 0, 0
    for index, row in enumerate(sample):
        if targets is not None and is_conversation(row.response):
            prompt, response, _ = targets.ids(row)
        else:
            prompt, response = renderer.sft_ids(row)
        if len(prompt) + len(response) > longest:
            longest, where = len(prompt) + len(response), index
    if longest > context:
        from sapo_megatron.errors import ConfigError

        raise ConfigError(
            f"the SFT sequences run to {longest} tokens (data.train row {where}: prompt + target"
            f"{', tool results included' if targets is not None else ''}), over the model's context "
            f"max_position_embeddings={context}: the warm start would train past it",
            hint=f"set model.hf_config max_position_embeddings to at least {longest} (or auto, which holds them "
            "unless data.max_prompt_tokens is set), or shorten the targets",
        )
    return (
        f"sft lengths OK: the longest SFT sequence is {longest} tokens, within the model's context {context}"
    )


def sft_settings(cfg: Any) -> dict[str, Any]:
    """How a run's SFT sequences are built and bounded (a :class:`~sapo_megatron.config.RunConfig`): the model's
    context, the turn end (``rollout.multi_turn.end_of_turn``), the template's arguments."""
    mt = cfg.rollout.multi_turn
    return {
        "context": cfg.model.arch.max_position_embeddings,
        "end_of_turn": mt.end_of_turn if mt is not None else None,
        "template_kwargs": cfg.data.chat_template_kwargs,
    }


def first_turn_length(
    renderer: PromptRenderer, *, context: int, end_of_turn: str | None, template_kwargs: dict[str, Any]
) -> Callable[[PromptRow], int] | None:
    """A messages-form row's first assistant turn in tokens as SFT trains it (None without a chat template)."""
    del context  # the sft_settings key that lengths do not need
    if renderer.hf is None:
        return None
    targets = ConversationTargets(renderer, end_of_turn, template_kwargs)

    def length(row: PromptRow) -> int:
        _, _, mask = targets.ids(row)
        return mask.index(0) if 0 in mask else len(mask)

    return length
