"""Messages-form SFT targets (issue 38, Build 5: a tool-use warm start in messages form), on the real Qwen3
tokenizer and template: the ids SFT trains on are the ids a multi-turn episode holds for the same conversation,
the loss mask covers the assistant turns only, and a target the policy could not write is one line.

All fail on 3855bb6 and on the branch before this test: a list ``response`` was refused ("must be a string") and
SFT had no loss mask but "the whole target"."""

from __future__ import annotations

import json

import pytest

from sapo_megatron.data.conversation import first_turn_call
from sapo_megatron.data.datasets import DatasetKeys, read_dataset
from sapo_megatron.data.prompts import DatasetError, PromptRow
from sapo_megatron.data.render import PromptRenderer, sft_target
from sapo_megatron.data.tokenizer import load_tokenizer
from sapo_megatron.errors import ConfigError
from sapo_megatron.loop.learning_signal import check_first_tool_call
from sapo_megatron.rollout.episodes.tools import PYTHON_SCHEMA
from sapo_megatron.rollout.episodes.warm_start import ConversationTargets, check_sft_lengths
from tests.rollout.episodes.test_qwen3_template import (
    EMPTY_THINK,
    OBSERVATIONS,
    PY1,
    QUESTION,
    SYSTEM,
    TURNS_THINKING,
    assistant,
    episode_ids,
    ids,
    messages_of,
    render,
)

KEYS = DatasetKeys(apply_chat_template=True, response_key="response")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


def targets(tok, **kwargs) -> ConversationTargets:
    keys = KEYS.model_copy(update={"chat_template_kwargs": kwargs})
    return ConversationTargets(PromptRenderer(tok, keys, tools=[PYTHON_SCHEMA]), "<|im_end|>", kwargs)


def row_of(turns) -> PromptRow:
    conversation = messages_of(turns)[2:]  # after the system and user messages
    return PromptRow(prompt=[SYSTEM, QUESTION], ground_truth="42", response=conversation)


def test_thinking_on_the_target_is_the_episode_and_the_whole_conversation(tok):
    """Turns with reasoning, structured tool calls, two grouped tool results: prompt + response equal the ids of
    the episode that generated these turns, and ``apply_chat_template`` of the whole conversation (but its final
    "\\n", never generated); the mask is 1 exactly on the three turns' ids, each ending at <|im_end|>."""
    hf = tok.hf
    prompt, response, mask = targets(tok).ids(row_of(TURNS_THINKING))
    episode = episode_ids(hf, [t[0] for t in TURNS_THINKING], {})
    assert prompt + response == episode
    assert prompt + response + ids(hf, "\n") == ids(hf, render(hf, messages_of(TURNS_THINKING)))
    end = hf.convert_tokens_to_ids("<|im_end|>")
    spans, current = [], []
    for token, m in zip(response, mask):
        if m:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    spans.append(current)
    assert [hf.decode(span) for span in spans] == [t[0] + "<|im_end|>" for t in TURNS_THINKING]
    assert all(span[-1] == end for span in spans) and len(spans) == 3
    unmasked = hf.decode([t for t, m in zip(response, mask) if not m])
    assert unmasked.count("<tool_response>") == 3 and "<think>" not in unmasked


def test_thinking_off_the_turns_follow_the_empty_think_block(tok):
    """``enable_thinking: false``: the generation prompts (the deltas' too) end with the empty think block, the
    turns are the content alone – the episode's ids, 4 tokens per earlier turn more than the whole rendering."""
    hf = tok.hf
    turns = [(t[0].split("</think>\n\n", 1)[1], t[1], t[2], None) for t in TURNS_THINKING]
    prompt, response, mask = targets(tok, enable_thinking=False).ids(row_of(turns))
    assert prompt + response == episode_ids(hf, [t[0] for t in turns], {"enable_thinking": False})
    trained = hf.decode([t for t, m in zip(response, mask) if m])
    assert "<think>" not in trained and trained.count("<|im_end|>") == 3
    assert hf.decode(prompt).endswith("<|im_start|>assistant\n" + EMPTY_THINK)


def test_a_turn_without_reasoning_keeps_the_empty_block_the_policy_writes(tok):
    """Thinking on, no reasoning in the first turn: its ids start with the empty think block (what the policy
    writes after ``<|im_start|>assistant\\n``), though the whole rendering leaves it out of earlier turns."""
    hf = tok.hf
    row = PromptRow(
        prompt=[SYSTEM, QUESTION],
        ground_truth="42",
        response=[
            assistant("", [PY1]),
            {"role": "tool", "content": "42\n"},
            assistant("\\boxed{42}", reasoning="It printed 42."),
        ],
    )
    _, response, mask = targets(tok).ids(row)
    first = hf.decode(response[: mask.index(0)])
    assert first.startswith(EMPTY_THINK + "<tool_call>") and first.endswith("</tool_call><|im_end|>")
    whole = render(hf, [SYSTEM, QUESTION, *row.response])
    assert EMPTY_THINK + "<tool_call>" not in whole


def test_reasoning_with_thinking_off_is_refused_in_one_line(tok):
    """A ``<think>`` block the generation prompt already closed could never be written by the policy."""
    row = PromptRow(prompt=[QUESTION], ground_truth="42", response=[assistant("42", reasoning="Add.")])
    with pytest.raises(DatasetError, match=r"assistant message 0 of the SFT target .* thinking"):
        targets(tok, enable_thinking=False).ids(row)


def test_the_dataset_reads_a_messages_form_target_and_refuses_bad_ones(tmp_path):
    """A list ``response`` is read as assistant / tool messages (extra keys dropped); a user message in it, a tool
    message last, or a non-string content is one line naming the row and the message."""
    good = [assistant("", [PY1]), {"role": "tool", "content": "42", "extra": 1}, assistant("\\boxed{42}")]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "12+30?", "ground_truth": "42", "response": good}) + "\n")
    [row] = read_dataset(str(path), KEYS).rows
    assert row.response[1] == {"role": "tool", "content": "42"}
    assert sft_target(row) == "\\boxed{42}"  # what the reward scores: the final answer
    for bad, message in (
        ([{"role": "user", "content": "x"}], "message 0 must be an object with role 'assistant' or 'tool'"),
        ([assistant("a"), {"role": "tool", "content": "b"}], "starts and ends with an assistant message"),
        ([{"role": "assistant", "content": 3}], "'content' must be a string"),
        ([assistant("a"), assistant("b")], "assistant message 1 follows an assistant message"),
        ([], "empty list of messages"),
    ):
        path.write_text(json.dumps({"prompt": "12+30?", "ground_truth": "42", "response": bad}) + "\n")
        with pytest.raises(DatasetError, match=message):
            read_dataset(str(path), KEYS)


def test_the_first_tool_call_of_a_messages_form_target_is_measured(tok):
    """The dry run's tool-call check reads a messages-form target's first turn (its structured call, as the
    template writes it) and warns when ``rollout.max_new_tokens`` cuts it."""
    result = {"role": "tool", "content": "42"}
    row = PromptRow(
        prompt="12+30?", ground_truth="42", response=[assistant("", [PY1]), result, assistant("42")]
    )
    warning = check_first_tool_call([row], tok, max_new_tokens=8)
    assert warning is not None and "max_new_tokens=8" in warning
    assert check_first_tool_call([row], tok, max_new_tokens=64) is None
    assert len(OBSERVATIONS) == 2  # the conversations above hold two rounds of results


def test_sft_sequences_longer_than_the_model_context_are_refused_before_sft(tok):
    """The issue's multi-turn user: a 128-token context, SFT trained ~550-token sequences without a word. Now the
    longest prompt + target (tool results included) is measured against ``max_position_embeddings`` before the
    warm start, and over it is one line naming the row and the number to set. Fails before this branch (no
    check existed)."""
    renderer = PromptRenderer(tok, KEYS, tools=[PYTHON_SCHEMA])
    rows = [PromptRow(prompt="1+1?", ground_truth="2"), row_of(TURNS_THINKING)]
    prompt, response, _ = targets(tok).ids(rows[1])
    longest = len(prompt) + len(response)
    settings = {"end_of_turn": "<|im_end|>", "template_kwargs": {}}
    line = check_sft_lengths(renderer, rows, context=longest, **settings)
    assert (
        line
        == f"sft lengths OK: the longest SFT sequence is {longest} tokens, within the model's context {longest}"
    )
    with pytest.raises(
        ConfigError, match=f"run to {longest} tokens \\(data.train row 1: .*tool results included"
    ):
        check_sft_lengths(renderer, rows, context=longest - 1, **settings)
    plain = PromptRenderer(tok, KEYS)
    short = rows[0]
    with pytest.raises(ConfigError) as refused:
        check_sft_lengths(plain, [short], context=4, **settings)
    assert "max_position_embeddings to at least 19" in str(refused.value.hint)
    assert sum(map(len, plain.sft_ids(short))) == 19


def test_a_template_that_drops_tool_calls_is_refused_in_one_line():
    """Found re-timing the tool user's path: the shipped ``chat`` template ignores ``tool_calls``, so a structured
    call in a messages-form target became an empty trained turn without a word. Fails before this test."""
    tok = load_tokenizer("chat")
    renderer = PromptRenderer(tok, KEYS)
    result = {"role": "tool", "content": "42"}
    row = PromptRow(
        prompt="12+30?", ground_truth="42", response=[assistant("", [PY1]), result, assistant("42")]
    )
    with pytest.raises(DatasetError, match=r"drops the tool_calls of assistant message 0 .* no 'python'"):
        ConversationTargets(renderer, None, {}).ids(row)
    written = json.dumps(PY1)
    as_text = [
        assistant(f"<tool_call>\n{written}\n</tool_call>"),
        {"role": "tool", "content": "42"},
        assistant("42"),
    ]
    _, response, mask = ConversationTargets(renderer, None, {}).ids(
        PromptRow(prompt="12+30?", ground_truth="42", response=as_text)
    )
    assert written in tok.hf.decode([t for t, m in zip(response, mask) if m])


def test_the_dry_run_measures_a_messages_form_first_turn_as_sft_trains_it(tok):
    """Qwen3 with thinking on: the first turn is the empty think block, the call and <|im_end|> – 4 + 1 tokens
    more than the call alone, which the dry run measured before (a 30-token budget looked enough for a 31-token
    turn). Fails before this test."""
    from sapo_megatron.rollout.episodes.warm_start import first_turn_length

    renderer = PromptRenderer(tok, KEYS, tools=[PYTHON_SCHEMA])
    result = {"role": "tool", "content": "42"}
    row = PromptRow(
        prompt="12+30?", ground_truth="42", response=[assistant("", [PY1]), result, assistant("42")]
    )
    length = first_turn_length(renderer, context=0, end_of_turn="<|im_end|>", template_kwargs={})
    assert length is not None
    call_alone = len(tok.encode(first_turn_call(row.response).lstrip("\n")))  # type: ignore[arg-type]
    turn = length(row)
    assert turn == call_alone + 4 + 1  # <think> "\n\n" </think> "\n\n", then <|im_end|>
    assert check_first_tool_call([row], tok, max_new_tokens=turn - 1) is None  # the call alone fits
    assert "up to 31 tokens" in str(check_first_tool_call([row], tok, turn - 1, length)) and turn == 31
