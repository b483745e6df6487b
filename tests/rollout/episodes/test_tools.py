"""Qwen3 tool-call parsing (SGLang's qwen25 detector semantics; tests/sglang_real compares with SGLang itself) and
user tools from a YAML file."""

from __future__ import annotations

import asyncio

import pytest

from sapo_megatron.rollout.episodes import ToolCall, ToolSet, parse_tool_calls
from sapo_megatron.rollout.episodes.tools import ToolSpecError, load_tools_file

TOOLS_YAML = """
tools:
  - import: tests.rollout.episodes.user_tools:add
    schema:
      type: function
      function:
        name: add
        description: Add two numbers
        parameters: {type: object, properties: {a: {type: number}, b: {type: number}}, required: [a, b]}
  - import: tests.rollout.episodes.user_tools:Scaled
    config: {factor: 3}
    schema: {type: function, function: {name: scale, parameters: {type: object}}}
"""


def test_qwen3_tool_calls_are_parsed_as_sglang_parses_them():
    text = (
        'I will add them.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "scale", "parameters": {"x": 4}}\n</tool_call><|im_end|>'
    )
    normal, calls = parse_tool_calls(text)
    assert normal == "I will add them."
    assert calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("scale", {"x": 4})]
    assert parse_tool_calls("no call here") == ("no call here", [])
    _, [bad] = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {1: 2}\n</tool_call>')
    assert bad.error.startswith("the tool call is not valid JSON")
    _, [nameless] = parse_tool_calls("<tool_call>\n[1, 2]\n</tool_call>")
    assert "must be a JSON object" in nameless.error
    _, [stringly] = parse_tool_calls(
        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    )
    assert stringly == ToolCall("add", {"a": 1})
    assert parse_tool_calls("<tool_call>\nunfinished") == ("", [])  # a turn cut before </tool_call>


def test_user_tools_from_a_yaml_file_run_with_their_config(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(TOOLS_YAML)
    tools = ToolSet(load_tools_file(path), timeout_s=1, max_concurrent=2, max_output_chars=100)
    assert [s["function"]["name"] for s in tools.schemas] == ["add", "scale"]
    assert asyncio.run(tools.call(ToolCall("add", {"a": 1, "b": 2.5}))).text == "3.5"
    assert asyncio.run(tools.call(ToolCall("scale", {"x": 2}))).text == "6"
    wrong = asyncio.run(tools.call(ToolCall("add", {"a": 1})))
    assert wrong.error and "TypeError" in wrong.text  # a missing argument is the model's error to learn from


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "- schema: {type: function, function: {name: x}}",
            r"tools\[0\]: needs 'import: package.module:name'",
        ),
        (
            "- import: tests.rollout.episodes.user_tools:add",
            r"tools\[0\]: schema must be an OpenAI function schema",
        ),
        (
            "- {import: tests.rollout.episodes.user_tools:missing, schema: {type: function, function: {name: m}}}",
            "has no attribute 'missing'",
        ),
        (
            "- {import: tests.rollout.episodes.user_tools:not_async, schema: {type: function, function: {name: n}}}",
            "must be an async function",
        ),
        (
            "- {import: tests.rollout.episodes.user_tools:add, config: {a: 1}, "
            "schema: {type: function, function: {name: n}}}",
            "'config' is for a class",
        ),
    ],
)
def test_bad_tool_entries_are_refused_naming_the_entry(tmp_path, entry, message):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  " + entry + "\n")
    with pytest.raises(ToolSpecError, match=message):
        load_tools_file(path)
    with pytest.raises(ToolSpecError, match="does not exist"):
        load_tools_file(tmp_path / "missing.yaml")


def test_the_concurrency_cap_holds_over_all_calls():
    running, peak = 0, 0

    async def busy(**_: object) -> str:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.02)
        running -= 1
        return "done"

    from sapo_megatron.rollout.episodes import Tool

    tools = ToolSet(
        [Tool({"type": "function", "function": {"name": "busy"}}, busy)],
        timeout_s=1,
        max_concurrent=3,
        max_output_chars=10,
    )

    async def many():
        return await asyncio.gather(*(tools.call(ToolCall("busy")) for _ in range(12)))

    assert [o.text for o in asyncio.run(many())] == ["done"] * 12
    assert peak == 3


def test_two_event_loops_share_a_tool_set():
    """A batch generated in the background while the main thread evaluates: two loops call the same tools."""
    from concurrent.futures import ThreadPoolExecutor

    from sapo_megatron.rollout.episodes import Tool

    async def nap(**_: object) -> str:
        await asyncio.sleep(0.05)
        return "ok"

    tools = ToolSet(
        [Tool({"type": "function", "function": {"name": "nap"}}, nap)],
        timeout_s=1,
        max_concurrent=2,
        max_output_chars=10,
    )

    def batch() -> list[str]:
        async def many():
            return await asyncio.gather(*(tools.call(ToolCall("nap")) for _ in range(6)))

        return [o.text for o in asyncio.run(many())]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: batch(), range(2)))
    assert results == [["ok"] * 6] * 2
