"""Episodes through the engine interface: :class:`EpisodeEngine` is a :class:`RolloutEngine` whose ``generate``
runs one episode per requested sample, so collection, dynamic sampling, evaluation and the loop use it unchanged;
scoring, weight sync and health go to the engine it wraps.

Concurrency: every episode of a ``generate`` call is a coroutine of one event loop. A turn waits on the
:class:`TurnBatcher`: for the in-process CPU engine (one call at a time) the turns that are ready together go as
one engine call, one forward; for servers (several calls in flight) each turn is its own call, so an episode goes
on to its tools the moment its own turn is back, never waiting for the slowest turn that happened to be ready at
the same moment (the servers batch continuously). Tool calls run meanwhile – so tools run while other episodes
generate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from sapo_megatron.errors import UserError
from sapo_megatron.rollout.base import RolloutEngine, RolloutError
from sapo_megatron.rollout.episodes.episode import (
    EpisodeContext,
    EpisodeDriftError,
    EpisodeFn,
    EpisodeLedger,
    EpisodeLimits,
)
from sapo_megatron.rollout.episodes.template import ObservationDeltas
from sapo_megatron.rollout.episodes.tools import ToolSet
from sapo_megatron.rollout.types import EpisodeInfo, GenerationRequest, ImageInputs, Sample

logger = logging.getLogger(__name__)


class EpisodeContextError(UserError):
    """No prompt of a batch leaves room to generate under ``rollout.multi_turn.max_context_tokens``."""


_GATHER_S = 0.01
"""With one engine call at a time (the CPU engine), a turn waits this long for the turns that become ready with
it (tool calls finish in their own threads, so results that arrive together are spread by a few ms)."""
_TURN_SEED_STRIDE = 7919  # turn k of a sample samples with seed + k · stride: reproducible, distinct per turn


class TurnBatcher:
    """Turns waiting for the engine: at most ``parallel_calls`` engine calls at a time. With one (the CPU
    engine computes one call at a time) a call takes every turn ready when it starts; with several (a client)
    a call is one turn, whose episode resumes when that turn alone is done – a call's results arrive together,
    so batching turns there would make each wait for the slowest of its batch."""

    def __init__(self, engine: RolloutEngine, parallel_calls: int, executor: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.parallel_calls = parallel_calls
        self.executor = executor
        self._pending: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._running = 0
        self.calls = 0

    async def generate(self, request: GenerationRequest) -> Sample:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if len(self._pending) == 1:  # after the other ready turns joined
            loop = asyncio.get_running_loop()
            if self.parallel_calls == 1:  # tool results arrive from their threads a few ms apart
                loop.call_later(_GATHER_S, self._dispatch)
            else:
                loop.call_soon(self._dispatch)
        return await future

    def _dispatch(self) -> None:
        while self._pending and self._running < self.parallel_calls:
            if self.parallel_calls == 1:
                batch, self._pending = self._pending, []
            else:
                batch = [self._pending.pop(0)]
            self._running += 1
            self.calls += 1
            asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: list[tuple[GenerationRequest, asyncio.Future]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            groups = await loop.run_in_executor(self.executor, self.engine.generate, [r for r, _ in batch])
        except Exception as error:  # every turn of the call sees it
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
        else:
            for (_, future), group in zip(batch, groups):
                if not future.done():
                    future.set_result(group[0])
        finally:
            self._running -= 1
            self._dispatch()


class EpisodeEngine(RolloutEngine):
    """``generate``: an episode (``episode_fn``, default the built-in tool loop) per sample of each request;
    everything else is ``engine``'s. ``deltas`` may be None for an episode function that appends its own
    observation ids (the built-in loop renders them)."""

    def __init__(
        self,
        engine: RolloutEngine,
        episode_fn: EpisodeFn,
        *,
        tools: ToolSet,
        deltas: ObservationDeltas | None,
        limits: EpisodeLimits,
        decode: Callable[[list[int]], str],
        parallel_calls: int,
        user_function: bool = False,
    ) -> None:
        self.engine = engine
        self.episode_fn = episode_fn
        self.tools = tools
        self.deltas = deltas
        self.limits = limits
        self.decode = decode
        self.parallel_calls = parallel_calls
        self.user_function = user_function
        self._engine_calls = ThreadPoolExecutor(
            max_workers=parallel_calls, thread_name_prefix="episode-turns"
        )
        self._counters = {"episode/failed": 0.0, "episode/engine_calls": 0.0}

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        return asyncio.run(self._generate(requests))

    async def _generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        batcher = TurnBatcher(self.engine, self.parallel_calls, self._engine_calls)
        turn_ids = itertools.count()  # a request id per turn: servers refuse a repeated one (SGLang's rid)
        episodes = [self._episode(batcher, req, i, turn_ids) for req in requests for i in range(req.n)]
        self._check_room(requests)
        try:
            samples = iter(await asyncio.gather(*episodes))
        finally:
            self._counters["episode/engine_calls"] += batcher.calls
        return [[next(samples) for _ in range(req.n)] for req in requests]

    def _check_room(self, requests: Sequence[GenerationRequest]) -> None:
        """Prompts that leave no room for one generated token under ``max_context_tokens`` end at once as
        truncated (counted in ``episode/no_room``); when that is every prompt of the call nothing could ever be
        trained, so it is an error naming the setting."""
        limit = self.limits.max_context_tokens
        full = [req for req in requests if len(req.prompt_ids) >= limit]
        self._counters["episode/no_room"] = self._counters.get("episode/no_room", 0.0) + sum(
            r.n for r in full
        )
        if full and len(full) == len(requests):
            longest = max(len(req.prompt_ids) for req in full)
            raise EpisodeContextError(
                f"rollout.multi_turn.max_context_tokens={limit} leaves no room for a single generated token: "
                f"every prompt of this batch is at least that long (the longest {longest} tokens)",
                hint="raise rollout.multi_turn.max_context_tokens above the prompts' length plus the turns you want",
            )
        if full:
            logger.warning(
                "%d of %d prompts are at least rollout.multi_turn.max_context_tokens=%d tokens long: their episodes "
                "end at once, untrained",
                len(full),
                len(requests),
                limit,
            )

    async def _episode(
        self, batcher: TurnBatcher, req: GenerationRequest, index: int, turn_ids: Iterator[int]
    ) -> Sample:
        ledger = EpisodeLedger(req.prompt_ids, f"group {req.group_id} sample {index}")
        seed = req.sampling.seed_for(index)

        async def turn(ids: list[int], max_new_tokens: int) -> Sample:
            ledger.check_input(ids)
            turn_seed = None if seed is None else seed + _TURN_SEED_STRIDE * ledger.turns
            sampling = dataclasses.replace(req.sampling, max_new_tokens=max_new_tokens, seed=turn_seed)
            request = GenerationRequest(
                prompt_ids=ids,
                n=1,
                sampling=sampling,
                return_routed_experts=req.return_routed_experts,
                group_id=next(turn_ids),
                routed_experts_start=0 if ledger.routes is None else len(ledger.routes),  # only the new rows
            )
            return await batcher.generate(request)

        # a turn's token limit is the request's (training: rollout.max_new_tokens; evaluation: the dataset's)
        limits = dataclasses.replace(self.limits, max_new_tokens=req.sampling.max_new_tokens)
        ctx = EpisodeContext(turn, self.tools, self.deltas, limits, self.decode)
        try:
            info = await self.episode_fn(ctx, ledger)
        except (EpisodeDriftError, RolloutError):
            raise
        except Exception as error:
            if not self.user_function:
                raise
            # slime's FAILED: the sample is not trained (its group is replaced), the run goes on
            logger.warning("episode function failed on %s: %s: %s", ledger.name, type(error).__name__, error)
            self._counters["episode/failed"] += 1
            info = EpisodeInfo(status="failed", turns=ledger.turns)
        if not isinstance(info, EpisodeInfo):
            raise TypeError(
                f"the episode function returned {type(info).__name__}, not EpisodeInfo ({ledger.name})"
            )
        return ledger.sample(req.group_id, index, info)

    # everything but generate is the wrapped engine's
    def score(
        self,
        token_ids_list: Sequence[Sequence[int]],
        response_start: int | Sequence[int],
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[list[float]]:
        return self.engine.score(token_ids_list, response_start, images)

    def update_weights_from_disk(self, path: str) -> None:
        self.engine.update_weights_from_disk(path)

    def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights_from_tensors(named_tensors)

    def finish_weight_update(self, *, flush_cache: bool = True) -> None:
        self.engine.finish_weight_update(flush_cache=flush_cache)

    def init_weights_update_group(self, *args, **kwargs) -> Future:
        return self.engine.init_weights_update_group(*args, **kwargs)

    def update_weights_from_distributed(self, *args, **kwargs) -> Future:
        return self.engine.update_weights_from_distributed(*args, **kwargs)

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    # a weight update under fully_async pauses the wrapped engine: a turn in flight spans it (its tokens carry
    # the engine's versions), turns asked for while paused wait for the new weights, tools run on meanwhile
    def pause_generation(self, mode: str = "in_place") -> None:
        self.engine.pause_generation(mode)

    def continue_generation(self) -> None:
        self.engine.continue_generation()

    def served_weight_version(self) -> int | None:
        return self.engine.served_weight_version()

    def health(self) -> bool:
        return self.engine.health()

    def metrics(self) -> dict[str, float]:
        return {**self.engine.metrics(), **self._counters}

    def close(self) -> None:
        self._engine_calls.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    def __getattr__(
        self, name: str
    ):  # engine-specific attributes (urls, num_layers, ...) of the wrapped engine
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Per-sample means of a batch's episodes: turns, tool calls, tool errors, and the fraction truncated (all,
    and by the limit that ended them); empty for single-turn samples."""
    infos = [s.episode for s in samples if s.episode is not None]
    if not infos:
        return {}
    n = len(infos)
    metrics = {
        "episode/turns_mean": sum(i.turns for i in infos) / n,
        "episode/tool_calls_mean": sum(i.tool_calls for i in infos) / n,
        "episode/tool_errors_mean": sum(i.tool_errors for i in infos) / n,
        "episode/truncated_frac": sum(i.status == "truncated" for i in infos) / n,
        "episode/completed_frac": sum(i.status == "completed" for i in infos) / n,
    }
    for reason in ("length", "max_turns", "max_tool_calls", "max_context"):
        metrics[f"episode/truncated_by_{reason}_frac"] = sum(i.truncated_by == reason for i in infos) / n
    metrics["episode/observation_tokens_mean"] = sum(
        len(s.response_ids) - s.generated_tokens for s in samples
    ) / len(samples)
    return metrics
