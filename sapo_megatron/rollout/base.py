"""The rollout engine interface. The trainer holds a :class:`RolloutEngine` and never knows which one.

Implementations: :class:`~sapo_megatron.rollout.sglang.client.SGLangClient` (SGLang servers over HTTP, also the
CPU server) and :class:`~sapo_megatron.rollout.cpu.engine.CPUEngine` (transformers, in-process).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

from sapo_megatron.errors import UserError
from sapo_megatron.rollout.types import GenerationRequest, ImageInputs, Sample


class RolloutError(UserError, RuntimeError):
    """A rollout engine failed or answered something that cannot be used.

    The message names the server, the request and the offending field so that a bad reply is never used silently.
    """

    def __init__(
        self, message: str, *, server: str | None = None, request: str | None = None, field: str | None = None
    ) -> None:
        self.server = server
        self.request = request
        self.field = field
        context = ", ".join(
            f"{name}={value}"
            for name, value in (("server", server), ("request", request), ("field", field))
            if value is not None
        )
        super().__init__(f"{message} [{context}]" if context else message)


class ContextLengthError(RolloutError, ValueError):
    """A request longer than the model's context: one line with the fix (a ``ValueError`` to the HTTP server,
    which answers 400 with it, as SGLang does)."""

    hint = (
        "raise the model's max_position_embeddings ('auto' sizes it from the prompts, their tool schemas, "
        "max_new_tokens and rollout.multi_turn.max_context_tokens), or lower max_new_tokens"
    )


class LocalServer(Protocol):
    """A server a run started in its own process (the CPU engine behind SGLang's HTTP API,
    ``rollout.cpu.server``, imported only where it is used); stopped when the run ends."""

    def stop(self) -> None: ...


class RolloutEngine(abc.ABC):
    """Generates samples, scores sequences and receives new weights."""

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        """Per request, its ``n`` samples in index order; requests keep their order."""

    @abc.abstractmethod
    def score(
        self,
        token_ids_list: Sequence[Sequence[int]],
        response_start: int | Sequence[int],
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[list[float]]:
        """Teacher scoring: for each sequence, ``log p(ids[t] | ids[:t])`` for ``t >= response_start``.

        ``images[i]``: the images of sequence ``i``, whose ids hold their pads expanded. A target that is an image
        pad gets 0.0 (masked: SGLang reports a placeholder token there, and no loss is taken on image tokens).

        Logprobs come from the raw logits (temperature 1), as SGLang's ``input_token_logprobs`` with
        ``max_new_tokens=0, logprob_start_len=0``. ``response_start`` is one value for all sequences or one per
        sequence, and must be >= 1 (the first token has no prefix). Each result has ``len(ids) - response_start``
        values.
        """

    @abc.abstractmethod
    def update_weights_from_disk(self, path: str) -> None:
        """Load the HF checkpoint directory ``path`` (config + safetensors) into every server, then flush caches."""

    @abc.abstractmethod
    def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (one bucket of them) into the served model (colocated weight sync); call
        :meth:`finish_weight_update` after the last bucket."""

    def finish_weight_update(self, *, flush_cache: bool = True) -> None:
        """End a weight update made of several calls: the new weights are complete; flush cached prefixes."""
        if flush_cache:
            self.flush_cache()

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offsets: Sequence[int],
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> Future:
        """Join the servers to a process group with the trainer for NCCL weight broadcast (disaggregated).

        Returns at once; the trainer joins the group, then waits on the future.
        """
        raise NotImplementedError(f"{type(self).__name__} has no NCCL weight-sync path")

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
    ) -> Future:
        """Receive the named tensors that the trainer broadcasts over the group of ``init_weights_update_group``.

        Returns at once; the trainer broadcasts the tensors in this order, then waits on the future.
        """
        raise NotImplementedError(f"{type(self).__name__} has no NCCL weight-sync path")

    def pause_generation(self, mode: str = "in_place") -> None:
        """Stop generating for a weight update, like SGLang's ``/pause_generation``: ``abort`` cuts running
        samples short (a client continues them after :meth:`continue_generation`), ``in_place`` keeps them with
        their cache, ``retract`` keeps their tokens and recomputes the cache with the new weights. Every sample
        carries ``token_versions`` (more than one version when it spans the update)."""
        raise NotImplementedError(f"{type(self).__name__} cannot pause generation")

    def continue_generation(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot pause generation")

    def served_weight_version(self) -> int | None:
        """The number of the weights served now, as the engine counts them in ``Sample.token_versions``; None when
        the engine does not report per-token versions."""
        return None

    @abc.abstractmethod
    def flush_cache(self) -> None:
        """Drop cached prefixes (after a weight change they belong to the old policy)."""

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the engine can serve requests now."""

    def metrics(self) -> dict[str, float]:
        """Cumulative counters (requests, retries, failovers, ...); the caller logs them."""
        return {}

    def close(self) -> None:  # noqa: B027 - engines without resources need no close
        """Release threads, connections and models."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def normalize_response_starts(
    token_ids_list: Sequence[Sequence[int]], response_start: int | Sequence[int]
) -> list[int]:
    """One validated ``response_start`` per sequence (shared by the engines' ``score``)."""
    if isinstance(response_start, int):
        starts = [response_start] * len(token_ids_list)
    else:
        starts = [int(s) for s in response_start]
        if len(starts) != len(token_ids_list):
            raise ValueError(
                f"score: {len(starts)} response_start values for {len(token_ids_list)} sequences"
            )
    for i, (ids, start) in enumerate(zip(token_ids_list, starts)):
        if not 1 <= start <= len(ids):
            raise ValueError(
                f"score: sequence {i} has {len(ids)} tokens; response_start={start} is not in [1, len]"
            )
    return starts
