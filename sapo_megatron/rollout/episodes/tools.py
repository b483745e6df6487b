"""Tools an episode can call: the built-in sandboxed Python interpreter and user tools by import path.

A tool is an async callable ``tool(**arguments) -> str`` with an OpenAI-style function schema (what the chat
template shows the model, as verl's tools YAML and Qwen's ``tools=`` hold it). :class:`ToolSet` runs the calls:
each in a thread of its own with its own event loop (a tool that blocks – ``time.sleep`` in an ``async def``, a
blocking socket – stalls only that thread, never the episodes' loop) under a hard per-call timeout, at most
``max_concurrent`` at once over all episodes (verl's and slime's retool semaphore). A tool that raises anything
(``BaseException`` included: ``SystemExit``, ``KeyboardInterrupt``, ``CancelledError``), times out, returns
something other than a ``str`` (named with the tool), or is not known answers with the error as its
observation, counted in ``tool_errors`` (the model learns from it; the run goes on). A call that timed out
leaves its thread behind until the tool returns (Python cannot stop a thread): ``tool_threads_stuck`` counts
them.

User tools come from a YAML file (``rollout.multi_turn.tools_file``)::

    tools:
      - import: my_pkg.search:search        # or path/to/file.py:search; an async function or a class
        config: {top_k: 3}                  # keyword arguments of the class (a class only)
        schema:                             # OpenAI function schema; its name is the name the model calls
          type: function
          function: {name: search, description: Search the web, parameters: {type: object, properties: {...}}}

A class is instantiated once with ``config``; the instance is then called. A function is called as it is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sapo_megatron.data.tool_schemas import PYTHON_SCHEMA  # the prompts show it too (sizing)
from sapo_megatron.errors import UserError
from sapo_megatron.rewards.loading import RewardSpecError, load_function
from sapo_megatron.rewards.sandbox import SandboxLimits, run_python
from sapo_megatron.rollout.episodes.tool_calls import ToolCall

ToolFn = Callable[..., Awaitable[str]]


class ToolSpecError(UserError):
    """A tools file or tool entry that cannot be used; the message names the entry and the field."""


@dataclass(frozen=True)
class Tool:
    """One tool: its OpenAI-style ``schema`` and the async function that runs it."""

    schema: dict[str, Any]
    run: ToolFn

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


@dataclass(frozen=True)
class ToolOutcome:
    """What one call gave: the observation text, and whether it is an error (raised, timed out, unknown)."""

    text: str
    error: bool = False


def python_tool(limits: SandboxLimits, executor: ThreadPoolExecutor) -> Tool:
    """The built-in ``python`` tool: the code runs in :func:`~sapo_megatron.rewards.sandbox.run_python` (the
    ``code_exec`` reward's sandbox, with its limits: wall and CPU time, memory, processes, no network) in a thread
    of ``executor``; the observation is its stdout, then its stderr (the traceback of an error)."""

    async def run(code: str) -> str:
        if not isinstance(code, str):
            raise TypeError(f"the python tool's 'code' must be a string, got {type(code).__name__}")
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(
            executor, lambda: run_python({"main.py": code}, "main.py", "", limits)
        )
        if result.timed_out:
            raise TimeoutError(f"the code timed out after {limits.wall_s:g} s")
        if result.returncode == 127 and result.stderr.startswith("sandbox setup failed"):
            raise RuntimeError("the sandbox could not start the code (an internal error, not the code's)")
        out = result.stdout + (result.stderr if result.returncode else "")
        return out if out else "(no output)"

    return Tool(PYTHON_SCHEMA, run)


class ToolSet:
    """The tools of a run and the rules every call follows (timeout, concurrency cap, output length)."""

    def __init__(
        self, tools: Sequence[Tool], *, timeout_s: float, max_concurrent: int, max_output_chars: int
    ) -> None:
        self.tools = {tool.name: tool for tool in tools}
        if len(self.tools) != len(tools):
            raise ToolSpecError(f"two tools share a name: {sorted(t.name for t in tools)}")
        self.timeout_s = timeout_s
        self.max_concurrent = max_concurrent
        self.max_output_chars = max_output_chars
        self.stuck: set[concurrent.futures.Future] = set()  # calls that timed out and still run
        # one semaphore per event loop: each generate call runs its own loop, and two can run at once (a batch
        # generated in the background while the main thread evaluates)
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema for tool in self.tools.values()]

    async def call(self, call: ToolCall) -> ToolOutcome:
        if call.error is not None:
            return ToolOutcome(f"Error: {call.error}", error=True)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolOutcome(
                f"Error: there is no tool {call.name!r} (tools: {sorted(self.tools)})", error=True
            )
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots[loop] = asyncio.Semaphore(self.max_concurrent)
        async with self._slots[loop]:
            future = _in_own_thread(tool, call.arguments)
            try:
                kind, value = await asyncio.wait_for(
                    asyncio.shield(asyncio.wrap_future(future)), self.timeout_s
                )
            except TimeoutError:
                self.stuck.add(future)
                future.add_done_callback(self.stuck.discard)
                return ToolOutcome(
                    f"Error: the tool {call.name} timed out after {self.timeout_s:g} s", error=True
                )
        if kind == "raised":  # the error is the observation (verl's BaseTool does the same)
            return ToolOutcome(f"Error: {value}", error=True)
        if not isinstance(value, str):
            return ToolOutcome(
                f"Error: the tool {call.name} returned {type(value).__name__}, not str (a tool returns text)",
                error=True,
            )
        return ToolOutcome(self._clip(str.__str__(value)))

    def _clip(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[: self.max_output_chars] + f"... (truncated to {self.max_output_chars} characters)"


def _in_own_thread(tool: Tool, arguments: Mapping[str, Any]) -> concurrent.futures.Future:
    """Run ``tool`` on ``arguments`` in a new daemon thread with its own event loop; the future's result is
    ``("returned", value)`` or ``("raised", "Type: message")`` – never an exception, whatever the tool raised."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        try:
            value = asyncio.run(_call(tool.run, dict(arguments)))
        except BaseException as exc:  # SystemExit, KeyboardInterrupt, CancelledError: the tool's, contained
            future.set_result(("raised", _describe(exc)))
        else:
            future.set_result(("returned", value))

    threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True).start()
    return future


async def _call(run: ToolFn, arguments: dict[str, Any]) -> Any:
    return await run(**arguments)


def _describe(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"[:2000]
    except BaseException:
        return f"{type(exc).__name__} (its message could not be shown)"


def load_tools_file(path: str | Path) -> list[Tool]:
    """The user tools a YAML file lists (see the module docstring)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ToolSpecError(f"rollout.multi_turn.tools_file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolSpecError(f"{path}: expected a list under 'tools:'")
    return [user_tool(entry, f"{path}: tools[{i}]") for i, entry in enumerate(entries)]


def user_tool(entry: Mapping[str, Any], where: str) -> Tool:
    """One user tool from its entry ``{import, schema, config}``."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("import"), str):
        raise ToolSpecError(f"{where}: needs 'import: package.module:name' (or path/to/file.py:name)")
    _check_schema(entry.get("schema"), where)
    try:
        target: Any = load_function(entry["import"])  # a user's function or class
    except RewardSpecError as error:
        raise ToolSpecError(f"{where}: {error}") from None
    config = entry.get("config") or {}
    if inspect.isclass(target):
        try:
            target = target(**config)
        except TypeError as error:
            raise ToolSpecError(f"{where}: {entry['import']}(**config) failed: {error}") from None
    elif config:
        raise ToolSpecError(f"{where}: 'config' is for a class; {entry['import']} is a function")
    run = target if inspect.iscoroutinefunction(target) else getattr(target, "__call__", None)  # noqa: B004
    if not inspect.iscoroutinefunction(run):
        raise ToolSpecError(
            f"{where}: {entry['import']} must be an async function (or a class with async __call__)"
        )
    return Tool(json.loads(json.dumps(entry["schema"])), run)


def _check_schema(schema: Any, where: str) -> None:
    function = schema.get("function") if isinstance(schema, Mapping) else None
    if (
        not isinstance(function, Mapping)
        or schema.get("type") != "function"
        or not isinstance(function.get("name"), str)
        or not function["name"]
    ):
        raise ToolSpecError(
            f"{where}: schema must be an OpenAI function schema {{type: function, function: {{name, description, "
            "parameters}}}}"
        )
    parameters = function.get("parameters", {"type": "object"})
    if not isinstance(parameters, Mapping):
        raise ToolSpecError(f"{where}: schema.function.parameters must be a JSON schema object")
    problem = _schema_problem(parameters)
    if problem:
        raise ToolSpecError(
            f"{where}: schema.function.parameters is not a JSON schema of the arguments ({problem}); write "
            "{type: object, properties: {NAME: {type: ...}}, required: [...]}"
        )


_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _schema_problem(parameters: Mapping[str, Any]) -> str | None:
    """What makes ``parameters`` no schema of a call's arguments (SGLang's server checks tool schemas with
    ``jsonschema``'s ``check_schema``; this checks the part a tool call relies on, without that package)."""
    if parameters.get("type", "object") != "object":
        return f"type is {parameters.get('type')!r}, not 'object': a call's arguments are an object"
    properties = parameters.get("properties", {})
    if not isinstance(properties, Mapping):
        return "properties is not a mapping of argument names to schemas"
    for name, schema in properties.items():
        if not isinstance(schema, Mapping):
            return f"properties.{name} is not a schema"
        kinds = schema.get("type")
        for kind in kinds if isinstance(kinds, list) else [kinds] if kinds is not None else []:
            if kind not in _JSON_TYPES:
                return f"properties.{name}.type {kind!r} is not a JSON schema type"
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) and r in properties for r in required):
        return "required must list names that are in properties"
    unknown = set(parameters) - {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "description",
        "$schema",
        "title",
        "definitions",
        "$defs",
    }
    if unknown:
        return f"unknown keys {sorted(unknown)}"
    return None
