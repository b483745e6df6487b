"""Multi-turn episodes with tools (docs/multi_turn.md): a sample is a sequence of engine turns and tool
observations on one token sequence, trained with a loss mask of several spans.

- :mod:`.episode`: the ledger (exact ids across turns, masks, log-probs, spliced routes) and the built-in loop;
- :mod:`.template`: observations as chat-template deltas; :mod:`.tool_calls`: Qwen3's tool-call format;
- :mod:`.tools`: the sandboxed Python tool, user tools by import path, timeouts and the concurrency cap;
- :mod:`.runner`: :class:`EpisodeEngine`, the engine interface over episodes (concurrent, turns batched).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sapo_megatron.config import MultiTurnConfig
from sapo_megatron.rewards.loading import RewardSpecError, load_function
from sapo_megatron.rewards.sandbox import SandboxLimits
from sapo_megatron.rollout.base import RolloutEngine
from sapo_megatron.rollout.episodes.episode import (
    EpisodeContext,
    EpisodeDriftError,
    EpisodeLedger,
    EpisodeLimits,
    tool_episode,
)
from sapo_megatron.rollout.episodes.runner import EpisodeEngine, episode_metrics
from sapo_megatron.rollout.episodes.template import ObservationDeltas
from sapo_megatron.rollout.episodes.tool_calls import ToolCall, parse_tool_calls
from sapo_megatron.rollout.episodes.tools import (
    PYTHON_SCHEMA,
    Tool,
    ToolSet,
    ToolSpecError,
    load_tools_file,
    python_tool,
)

__all__ = [
    "EpisodeContext",
    "EpisodeDriftError",
    "EpisodeEngine",
    "EpisodeLedger",
    "EpisodeLimits",
    "ObservationDeltas",
    "Tool",
    "ToolCall",
    "ToolSet",
    "build_tools",
    "episode_metrics",
    "parse_tool_calls",
    "tool_episode",
    "tool_schemas",
    "with_episodes",
    "with_run_episodes",
]


def tool_schemas(mt: MultiTurnConfig | None) -> list[dict[str, Any]] | None:
    """The schemas of the run's tools, for the prompts' chat template (None without multi-turn episodes)."""
    if mt is None:
        return None
    schemas = [PYTHON_SCHEMA] if mt.python_tool else []
    if mt.tools_file:
        schemas += [tool.schema for tool in load_tools_file(mt.tools_file)]
    return schemas or None


def build_tools(mt: MultiTurnConfig) -> ToolSet:
    """The run's tools: the sandboxed Python tool (unless switched off) and the tools file's."""
    tools: list[Tool] = []
    if mt.python_tool:
        # the call's timeout caps the code's: a sandbox never runs on after its call has answered "timed out"
        wall_s = min(mt.python_timeout_s, mt.tool_timeout_s)
        limits = SandboxLimits(wall_s=wall_s, cpu_s=max(1, int(wall_s)), memory_mb=mt.python_memory_mb)
        # a thread per running call: it only waits on the sandbox's process (the cap is ToolSet's semaphore)
        pool = ThreadPoolExecutor(mt.max_concurrent_tools, thread_name_prefix="python-tool")
        tools.append(python_tool(limits, pool))
    if mt.tools_file:
        tools += load_tools_file(mt.tools_file)
    return ToolSet(
        tools,
        timeout_s=mt.tool_timeout_s,
        max_concurrent=mt.max_concurrent_tools,
        max_output_chars=mt.max_tool_output_chars,
    )


def with_run_episodes(engine: RolloutEngine | None, cfg: Any, tokenizer: Any, *, in_process: bool):
    """``engine`` generating episodes when the run config ``cfg`` sets ``rollout.multi_turn`` (else ``engine``
    itself): for training (the session) and evaluation (``sapo-megatron eval``). ``in_process``: an engine that
    computes one forward at a time (the CPU engine), which then gets all ready turns in one call."""
    r = cfg.rollout
    if r.multi_turn is None or engine is None:
        return engine
    return with_episodes(
        engine,
        r.multi_turn,
        tokenizer.hf,
        max_new_tokens=r.max_new_tokens,
        template_kwargs=cfg.data.chat_template_kwargs,
        parallel_calls=1 if in_process else r.concurrency,
    )


def with_episodes(
    engine: RolloutEngine,
    mt: MultiTurnConfig,
    hf_tokenizer: Any,
    *,
    max_new_tokens: int,
    template_kwargs: dict[str, Any],
    parallel_calls: int,
    tools: ToolSet | None = None,
) -> EpisodeEngine:
    """``engine`` generating episodes under ``mt`` (the session wraps its rollout engine with this)."""
    episode_fn, user = tool_episode, False
    if mt.episode_function:
        try:
            episode_fn, user = load_function(mt.episode_function), True
        except RewardSpecError as error:
            raise ToolSpecError(f"rollout.multi_turn.episode_function: {error}") from None
    end_of_turn = mt.end_of_turn or hf_tokenizer.eos_token
    limits = EpisodeLimits(
        max_turns=mt.max_turns,
        max_tool_calls=mt.max_tool_calls,
        max_context_tokens=mt.max_context_tokens,
        max_new_tokens=max_new_tokens,
    )
    return EpisodeEngine(
        engine,
        episode_fn,
        tools=tools if tools is not None else build_tools(mt),
        deltas=ObservationDeltas(hf_tokenizer, end_of_turn, template_kwargs),
        limits=limits,
        decode=lambda ids: hf_tokenizer.decode(ids, skip_special_tokens=False),
        parallel_calls=mt.parallel_engine_calls or parallel_calls,
        user_function=user,
    )
