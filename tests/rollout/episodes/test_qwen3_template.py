"""Multi-turn episodes on the real Qwen3 tokenizer and chat template (issue 38, item 2; ``make qwen3-tokenizer``).

Qwen3's template is where multi-turn RL breaks in practice: it writes the tool schemas into the system turn,
groups consecutive tool results into ONE ``user`` turn of ``<tool_response>`` blocks, renders the *last*
assistant turn with a ``<think>`` block that it leaves out once more messages follow (the delta's dummy
conversation on 3855bb6 ended with an assistant reply and was refused: "the chat template rewrites earlier
turns"), keeps the thinking of every turn after the last user query, and drops it before that query.
"""

from __future__ import annotations

import json

import pytest

from sapo_megatron.rollout.episodes import ObservationDeltas, Tool, ToolSet, parse_tool_calls
from sapo_megatron.rollout.episodes.tools import PYTHON_SCHEMA
from sapo_megatron.rollout.types import EpisodeInfo, GenerationRequest, SamplingParams
from tests.data.qwen3_fixtures import qwen3
from tests.rollout.episodes.helpers import ScriptedEngine, call, episode_engine

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
QUESTION = {"role": "user", "content": "12+30?"}
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def hf():
    return qwen3()


def ids(hf, text: str) -> list[int]:
    return list(hf(text, add_special_tokens=False)["input_ids"])


def render(hf, messages, **kwargs) -> str:
    return hf.apply_chat_template(messages, tools=[PYTHON_SCHEMA], tokenize=False, **kwargs)


def assistant(text: str, calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
    """An assistant message in the OpenAI form the template reads: reasoning, content and structured calls."""
    message: dict = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"type": "function", "function": call} for call in calls]
    return message


PY1 = {"name": "python", "arguments": {"code": "print(12 + 30)"}}
PY2 = {"name": "python", "arguments": {"code": "print(42)"}}


def written(c: dict) -> str:
    return call(c["name"], **c["arguments"])


# what the model writes (thinking on): reasoning, text, calls, in the template's own format
TURNS_THINKING = [
    (
        "<think>\nTwo checks.\n</think>\n\nChecking.\n" + written(PY1) + "\n" + written(PY2),
        "Checking.",
        [PY1, PY2],
        "Two checks.",
    ),
    ("<think>\nAgain.\n</think>\n\n" + written(PY1), "", [PY1], "Again."),
    ("<think>\nDone.\n</think>\n\nThe answer is \\boxed{42}.", "The answer is \\boxed{42}.", [], "Done."),
]
OBSERVATIONS = [["42\n", "42\n"], ["42\n"]]


def episode_ids(hf, turns: list[str], kwargs: dict) -> tuple[list[int], list[dict]]:
    """The token ids an episode holds (the prompt, each turn's ids up to <|im_end|>, each observation delta) and
    the conversation's messages in the OpenAI form."""
    end = hf.convert_tokens_to_ids("<|im_end|>")
    deltas = ObservationDeltas(hf, "<|im_end|>", kwargs)
    episode = ids(hf, render(hf, [SYSTEM, QUESTION], add_generation_prompt=True, **kwargs))
    for k, text in enumerate(turns):
        episode += [*ids(hf, text), end]
        if k < len(OBSERVATIONS):
            episode += deltas.ids([{"role": "tool", "content": out} for out in OBSERVATIONS[k]])
    return episode


def messages_of(turns) -> list[dict]:
    messages = [SYSTEM, QUESTION]
    for k, (_, content, calls, reasoning) in enumerate(turns):
        messages.append(assistant(content, calls, reasoning))
        if k < len(OBSERVATIONS):
            messages += [{"role": "tool", "content": out} for out in OBSERVATIONS[k]]
    return messages


def test_thinking_on_the_episode_is_the_whole_conversation_rendered_at_once(hf):
    """Deltas of tool results (grouped into one user turn) between turns that think and call tools equal
    ``apply_chat_template`` of the whole conversation – tool schemas, structured tool calls, reasoning kept in the
    earlier turns because they follow the last user query – tokenized at once. Fails on 3855bb6 (the delta's dummy
    reply made ObservationDeltas refuse Qwen3's template)."""
    episode = episode_ids(hf, [t[0] for t in TURNS_THINKING], {})
    whole = ids(hf, render(hf, messages_of(TURNS_THINKING)))
    assert whole == episode + ids(
        hf, "\n"
    )  # the template's "\n" after the last <|im_end|> was never generated
    think, tool_call, tool_response = hf.convert_tokens_to_ids(["<think>", "<tool_call>", "<tool_response>"])
    prompt = len(ids(hf, render(hf, [SYSTEM, QUESTION], add_generation_prompt=True)))
    response = episode[prompt:]  # the system turn's tool instructions hold <tool_call> twice
    assert (response.count(think), response.count(tool_call), response.count(tool_response)) == (3, 3, 3)
    text = hf.decode(episode)
    assert text.count("<|im_start|>user\n<tool_response>") == 2  # one user turn per round of results
    assert (
        "<tool_response>\n42\n\n</tool_response>\n<tool_response>\n42\n\n</tool_response><|im_end|>" in text
    )


def test_thinking_off_keeps_the_empty_think_block_the_model_saw(hf):
    """``chat_template_kwargs: {enable_thinking: false}``: every generation prompt, the deltas' included, ends
    with Qwen3's empty think block, and the model answered after it. Re-rendering the finished conversation
    drops that block from the earlier turns (the template writes it for the last one only); the episode keeps
    what the policy was conditioned on: exactly 4 tokens more per earlier turn."""
    kwargs = {"enable_thinking": False}
    turns = [(t[0].split("</think>\n\n", 1)[1], t[1], t[2], None) for t in TURNS_THINKING]
    episode = episode_ids(hf, [t[0] for t in turns], kwargs)
    rendered = render(hf, messages_of(turns), **kwargs)
    assert rendered.count(EMPTY_THINK) == 1  # the last turn's only
    header = "<|im_start|>assistant\n"
    as_generated = (
        rendered.replace(header + "<think>", "\0")
        .replace(header, header + EMPTY_THINK)
        .replace("\0", header + "<think>")
    )
    assert episode + ids(hf, "\n") == ids(hf, as_generated)
    assert len(episode) + 1 - len(ids(hf, rendered)) == 4 * (len(turns) - 1)
    assert ids(hf, EMPTY_THINK) == [151667, 271, 151668, 271]  # <think> "\n\n" </think> "\n\n"


def test_a_new_user_query_drops_earlier_thinking_in_the_template_not_in_the_episode(hf):
    """Qwen3's template keeps reasoning only after the last user query. An episode that appends a user message
    (a user episode function may) cannot rewrite the turns before it: the delta is append-only and the earlier
    reasoning stays in the ids (what the policy saw); the template's rendering of the same conversation lacks it."""
    deltas = ObservationDeltas(hf, "<|im_end|>", {})
    follow_up = {"role": "user", "content": "And 1+1?"}
    assert deltas.text([follow_up]) == "\n<|im_start|>user\nAnd 1+1?<|im_end|>\n<|im_start|>assistant\n"
    first = assistant("42.", reasoning="Add them.")
    before = render(hf, [SYSTEM, QUESTION, first])
    after = render(hf, [SYSTEM, QUESTION, first, follow_up, assistant("2.", reasoning="Easy.")])
    assert "<think>\nAdd them.\n</think>" in before and "Add them." not in after
    assert "<think>\nEasy.\n</think>" in after


def test_an_episode_on_the_real_template_with_a_tool(hf):
    """The episode engine end to end on Qwen3's tokenizer: ``<tool_call>`` is one token of the model's output,
    decoded and parsed after the thinking block, the tool's result comes back as a ``<tool_response>`` user turn,
    and the sample's ids are the whole conversation's."""

    async def add(a: int, b: int) -> str:
        return str(a + b)

    schema = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    tools = ToolSet([Tool(schema, add)], timeout_s=5, max_concurrent=2, max_output_chars=100)
    first = "<think>\nUse the tool.\n</think>\n\n" + call("add", a=12, b=30)
    last = "<think>\nIt said 42.\n</think>\n\nThe answer is \\boxed{42}."
    engine = ScriptedEngine(hf, {"12+30": [first, last]})
    episodes = episode_engine(engine, hf, tools=tools)
    prompt = ids(
        hf,
        hf.apply_chat_template(
            [SYSTEM, QUESTION], tools=[schema], tokenize=False, add_generation_prompt=True
        ),
    )
    sampling = SamplingParams(max_new_tokens=64, seed=5)
    [[sample]] = episodes.generate([GenerationRequest(prompt_ids=prompt, n=1, sampling=sampling, group_id=0)])
    assert sample.episode == EpisodeInfo(status="completed", turns=2, tool_calls=1, tool_errors=0)
    assert hf.convert_tokens_to_ids("<tool_call>") in sample.response_ids
    messages = [
        SYSTEM,
        QUESTION,
        assistant("", [{"name": "add", "arguments": {"a": 12, "b": 30}}], "Use the tool."),
        {"role": "tool", "content": "42"},
        assistant("The answer is \\boxed{42}.", reasoning="It said 42."),
    ]
    whole = hf.apply_chat_template(messages, tools=[schema], tokenize=False)
    assert ids(hf, whole) == sample.token_ids + ids(hf, "\n")
    observation = [i for i, m in zip(sample.response_ids, sample.loss_mask) if m == 0]
    assert (
        hf.decode(observation)
        == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_tool_calls_in_model_ids_parse_as_sglang_qwen3_and_qwen25_parsers_do(hf):
    """SGLang takes the thinking block off (``--reasoning-parser qwen3``) before its ``qwen25`` tool parser reads
    the rest: a call written while thinking is no call; a block cut before ``</think>`` ends at a ``<tool_call>``.
    Fails on 3855bb6 (it ran the call inside the thinking block)."""
    inside = "<think>\nMaybe <tool_call>\n" + json.dumps(PY2) + "\n</tool_call> later.\n</think>\n\nNo call."
    text = hf.decode(ids(hf, inside))
    assert text == inside and parse_tool_calls(text) == ("\n\nNo call.", [])
    unclosed = "<think>\nrun it\n" + written(PY1)
    normal, [parsed] = parse_tool_calls(
        hf.decode([*ids(hf, unclosed), hf.convert_tokens_to_ids("<|im_end|>")], skip_special_tokens=False)
    )
    assert (normal, parsed.name, parsed.arguments) == ("", "python", PY1["arguments"])
    normal, calls = parse_tool_calls(TURNS_THINKING[0][0])
    assert normal == "Checking." and [(c.name, c.arguments) for c in calls] == [
        ("python", PY1["arguments"]),
        ("python", PY2["arguments"]),
    ]
