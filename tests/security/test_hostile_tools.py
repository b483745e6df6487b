"""Hostile and careless tools (issue 39, area "tools"): a tool that blocks the event loop or never returns, that
raises anything (``BaseException`` included), that returns no ``str``, a tools file whose ``parameters`` are no
JSON schema, a Python tool allowed longer than its call, ``{"code": 123}``, a ``max_context_tokens`` below every
prompt, and a command that did not finish. Each is an error observation counted in ``tool_errors`` (OK: the run
goes on and the model sees the error), or a one-line refusal (CLEAR). On 3855bb6: hangs, tracebacks, and silence
(``None`` became the observation "None"; ``SystemExit(0)`` ended ``train`` with exit status 0)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sapo_megatron.config import MultiTurnConfig
from sapo_megatron.rollout.episodes import ToolCall, ToolSet, build_tools
from sapo_megatron.rollout.episodes.tools import Tool, load_tools_file
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams
from tests.rollout.episodes.helpers import ScriptedEngine, chat_tokenizer, episode_engine, prompt_ids
from tests.security.hostile import case, expect

AREA = "tools"
RELEASE = threading.Event()  # set at the end of the module: the forever-blocking tool's thread ends


@pytest.fixture(scope="module", autouse=True)
def release_blocked_threads():
    yield
    RELEASE.set()


def schema(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text")


class LoudError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message either")


async def sleeps(**_: object) -> str:
    time.sleep(3)  # blocks the loop it runs on
    return "late"


async def blocks_forever(**_: object) -> str:
    RELEASE.wait()
    return "never seen"


def raising(exc: BaseException):
    async def tool(**_: object) -> str:
        raise exc

    return tool


def returning(value: object):
    async def tool(**_: object) -> object:
        return value

    return tool


async def fine(**_: object) -> str:
    return "fine"


def run_calls(fn, *, timeout_s: float = 1.0) -> tuple[object, float, str]:
    """The call of tool ``t``, and (concurrently) of a quick tool: the quick one must not wait for ``t``."""
    tools = ToolSet(
        [Tool(schema("t"), fn), Tool(schema("quick"), fine)],
        timeout_s=timeout_s,
        max_concurrent=4,
        max_output_chars=200,
    )

    async def both():
        started = time.perf_counter()
        quick_done = []

        async def quick():
            outcome = await tools.call(ToolCall("quick", {}))
            quick_done.append(time.perf_counter() - started)
            return outcome

        outcome, quick_outcome = await asyncio.gather(tools.call(ToolCall("t", {})), quick())
        assert quick_outcome.text == "fine"
        return outcome, quick_done[0]

    started = time.perf_counter()
    outcome, quick_s = asyncio.run(both())
    return outcome, time.perf_counter() - started, f"quick after {quick_s:.2f} s"


@pytest.mark.parametrize(
    ("cls", "fn", "words"),
    [
        case(AREA, "async tool blocking in time.sleep", "OK", sleeps, "timed out after 1 s"),
        case(AREA, "async tool blocking forever", "OK", blocks_forever, "timed out after 1 s"),
    ],
)
def test_a_blocking_tool_stalls_neither_the_loop_nor_the_other_calls(cls, fn, words):
    outcome, seconds, quick = expect(cls, lambda: run_calls(fn))
    assert outcome.error and words in outcome.text
    assert seconds < 2.5, f"{seconds:.2f} s for a 1 s timeout"  # the old code: 3 s, or never
    assert float(quick.split()[2]) < 1.0, quick  # answered at once, not after the blocker (3 s)


@pytest.mark.parametrize(
    ("cls", "fn", "words"),
    [
        case(
            AREA,
            "str() of the result raises",
            "OK",
            returning(Unprintable()),
            "returned Unprintable, not str",
        ),
        case(AREA, "tool raises CancelledError", "OK", raising(asyncio.CancelledError()), "CancelledError"),
        case(AREA, "tool raises SystemExit(0)", "OK", raising(SystemExit(0)), "SystemExit: 0"),
        case(AREA, "tool returns None", "OK", returning(None), "the tool t returned NoneType, not str"),
    ],
)
def test_whatever_a_tool_raises_or_returns_is_an_error_observation(cls, fn, words):
    outcome, _, _ = expect(cls, lambda: run_calls(fn))
    assert outcome.error and words in outcome.text, outcome


def test_keyboard_interrupt_and_an_unprintable_exception_are_contained_too():
    for fn, words in (
        (raising(KeyboardInterrupt()), "KeyboardInterrupt"),
        (raising(LoudError()), "LoudError"),
    ):
        outcome, _, _ = run_calls(fn)
        assert outcome.error and words in outcome.text, outcome


def test_errors_are_counted_in_the_episode():
    hf = chat_tokenizer()
    tools = ToolSet(
        [Tool(schema("t"), raising(SystemExit(0)))], timeout_s=2.0, max_concurrent=2, max_output_chars=200
    )
    call = '<tool_call>\n{"name": "t", "arguments": {}}\n</tool_call>'
    engine = ScriptedEngine(hf, {"Go": [call, "Done."]})
    request = GenerationRequest(
        prompt_ids=prompt_ids(hf, "Go."), n=1, sampling=SamplingParams(max_new_tokens=64), group_id=0
    )
    [[sample]] = episode_engine(engine, hf, tools=tools).generate([request])
    assert sample.episode.tool_errors == 1 and sample.episode.status == "completed"


@pytest.mark.parametrize(
    ("cls", "parameters", "words"),
    [
        case(AREA, "parameters not a JSON schema", "CLEAR", "{type: string}", "not 'object'"),
        pytest.param(
            "CLEAR", "{type: object, properties: {q: 5}}", "properties.q is not a schema", id="prop"
        ),
        pytest.param(
            "CLEAR", "{type: object, properties: {q: {type: text}}}", "'text' is not a JSON", id="type"
        ),
        pytest.param(
            "CLEAR", "{type: object, properties: {}, required: [q]}", "required must list", id="req"
        ),
        pytest.param("CLEAR", "{a: 1}", "unknown keys", id="keys"),
    ],
)
def test_a_tools_file_whose_parameters_are_no_schema_is_refused(tmp_path, cls, parameters, words):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n  - {import: tests.rollout.episodes.user_tools:add, "
        f"schema: {{type: function, function: {{name: add, parameters: {parameters}}}}}}}\n"
    )
    expect(cls, lambda: load_tools_file(path), "tools[0]", "not a JSON schema of the arguments", words)


def sandbox_processes() -> list[int]:
    """The sandbox launchers this test process started that still run (other processes' are not counted)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or b"sandbox_boot.py" not in (entry / "cmdline").read_bytes():
                continue
            status = (entry / "status").read_text()
        except OSError:
            continue
        parent = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
        if int(parent) == os.getpid():
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("cls", [case(AREA, "python timeout above the call's", "OK")])
def test_the_python_tools_timeout_is_capped_by_the_calls(cls):
    tools = build_tools(MultiTurnConfig(python_timeout_s=60.0, tool_timeout_s=1.0))
    started = time.perf_counter()
    outcome = expect(
        cls, lambda: asyncio.run(tools.call(ToolCall("python", {"code": "while True:\n    pass"})))
    )
    assert outcome.error and "timed out" in outcome.text
    assert time.perf_counter() - started < 10.0  # the call's 1 s (+ start-up under load), not the code's 60 s
    deadline = time.monotonic() + 5.0
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sandbox_processes() == []  # the sandbox stopped with its call, not 60 s later


@pytest.mark.parametrize("cls", [case(AREA, "python tool with code 123", "OK")])
def test_the_python_tool_names_a_code_that_is_no_string(cls):
    tools = build_tools(MultiTurnConfig(python_timeout_s=5.0))
    outcome = expect(cls, lambda: asyncio.run(tools.call(ToolCall("python", {"code": 123}))))
    assert outcome.error and "'code' must be a string, got int" in outcome.text


@pytest.mark.parametrize("cls", [case(AREA, "max_context_tokens below every prompt", "CLEAR")])
def test_no_room_for_any_prompt_is_refused(cls):
    hf = chat_tokenizer()
    engine = ScriptedEngine(hf, {"Go": ["Done."]})
    episodes = episode_engine(engine, hf, max_context_tokens=8)
    request = GenerationRequest(
        prompt_ids=prompt_ids(hf, "Go."), n=2, sampling=SamplingParams(max_new_tokens=64), group_id=0
    )
    expect(cls, lambda: episodes.generate([request]), "max_context_tokens=8", "no room")


@pytest.mark.parametrize("cls", [case(AREA, "tool raises SystemExit(0)", "OK")])
def test_a_command_ended_by_system_exit_never_exits_0(cls, capsys):
    from sapo_megatron.cli import _run

    def handler(_args):
        raise SystemExit(0)

    code = _run(SimpleNamespace(handler=handler), [], is_main=True, debug=False)
    assert code == 1
    assert "did not finish: SystemExit(0)" in capsys.readouterr().err
