"""The tool schemas a run's prompts show (the chat template's ``tools=``), for measuring prompts where the tools
themselves are not loaded: the auto-sized context (:mod:`~sapo_megatron.data.sizing`) must count the schemas the
template writes into the system turn, as the engine will receive them.

The built-in ``python`` tool's schema lives here; the episode engine (``rollout/episodes/tools.py``) runs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PYTHON_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code in a sandbox and return what it prints (stdout, then stderr).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python program to run"}},
            "required": ["code"],
        },
    },
}


def prompt_tool_schemas(multi_turn: Any) -> list[dict[str, Any]] | None:
    """The schemas of ``rollout.multi_turn``'s tools (None without multi-turn episodes): the python tool's unless
    switched off, then each ``schema`` of the tools file, read as YAML without importing the tools (a missing or
    malformed file is the episode engine's to report)."""
    if multi_turn is None:
        return None
    schemas = [PYTHON_SCHEMA] if multi_turn.python_tool else []
    if multi_turn.tools_file:
        schemas += _file_schemas(Path(multi_turn.tools_file))
    return schemas or None


def _file_schemas(path: Path) -> list[dict[str, Any]]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []
    entries = data.get("tools") if isinstance(data, dict) else None
    return [e["schema"] for e in entries or [] if isinstance(e, dict) and isinstance(e.get("schema"), dict)]
