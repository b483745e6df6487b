"""MoE routing replay (R2, R3) through Megatron-Core's own ``RouterReplay``.

Micro-batch keys (int32 CPU tensors ``[b, s, L, k]``: batch row, model position, global layer index 0..L-1, top-k
slot; ``NO_ROUTE`` (-1) on dense layers and on layers this pipeline stage does not own):

- ``engine_routes``: the rollout engine's routes laid onto the trainer's positions (:mod:`sapo_megatron.model.batching`).
- ``recorded_routes``: what this rank's routers chose in a recording forward-only pass
  (``TrainEngine.forward_only(..., record_routes=True)``): this stage's MoE layers, whole sequences (the
  sequence-parallel slices of the tensor-parallel ranks are gathered back).
- ``used_routes``: what the routers used in a training forward (``train_step(..., record_routes=True)``): the
  replayed routes (the replay source itself), or the live ones recorded without replay.

What this relies on in Megatron-Core (``transformer/moe/router_replay.py`` and ``router.py``, checked in 0.16.1
and 0.19.2, whose ``RouterReplay`` differ only by 0.19's CUDA-graph static buffers, unused here):

- ``TopKRouter.__init__`` creates one ``RouterReplay`` per router when ``config.moe_enable_routing_replay``
  (``router.router_replay``); each also lands in the class-wide ``global_router_replay_instances``, which keeps
  the routers of every model ever built in the process – so this module drives each router's *own* instance and
  never the global static helpers.
- ``get_replay_topk`` (called from ``moe_utils.topk_routing_with_score_function`` through ``compute_topk``):
  RECORD stores the live ``topk`` indices in ``recorded_topk_idx``; REPLAY_FORWARD uses ``target_topk_idx``;
  REPLAY_BACKWARD pops ``replay_backward_list``, a FIFO that ``set_target_indices`` appends to. Both replay
  actions return ``scores.gather(1, idx)``: with softmax-after-top-k the gathered *logits* are softmaxed, with
  pre-softmax the gathered full-softmax probabilities are used – the router keeps its gradient through the
  replayed experts. Indices must be int64 on the scores' device (``gather``). The aux loss, when on, keeps its
  own live top-k (``compute_routing_scores_for_aux_loss``).
- The router sees ``[s/tp, b]`` tokens flattened sequence-major (``logits.view(-1, E)``) when sequence
  parallelism splits the sequence over tensor-parallel ranks, ``[s, b]`` otherwise; expert parallelism
  dispatches only after routing, so it does not change what a router sees.
- Silently skipped (hence refused here): ``moe_router_fusion`` (the fused kernel returns before ``compute_topk``)
  and sinkhorn / quantile-balancing routing (they do not call ``topk_routing_with_score_function``'s top-k).

Schedule: per micro-batch, before its forward, every local router gets that micro-batch's targets and
REPLAY_FORWARD. When the backward recomputes the routers (``moe_layer_recompute``, full recomputation) they switch
to REPLAY_BACKWARD right after the forward, so any later router call pops the FIFO: Megatron's schedules run
backwards in forward order (no virtual pipeline), so each recomputation gets its own micro-batch's routes.
Without recomputation the targets are dropped after the forward. (Verified on CPU with MoE-layer recomputation;
full-layer recomputation takes the same path but Megatron's recomputed attention does not run on the CPU
compatibility layer.) Recorded routes go to the CPU after each
micro-batch's forward. All state (targets, FIFO, recorded indices, actions) is cleared after every pass, on
error too.

Context parallelism: a router sees this CP rank's chunks of each sequence
(:mod:`~sapo_megatron.megatron.context_parallel`); replayed routes are sliced to them, recorded ones gathered back
into whole sequences, so the micro-batch keys above always hold whole sequences.
Not supported (refused): virtual pipeline stages (interleaved order), multi-token prediction (MTP routers share
layer numbers), the fused router, sinkhorn/quantile routing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.transformer_config import TransformerConfig

from sapo_megatron.megatron.context_parallel import batch_shards, gather_tokens, shard_tokens
from sapo_megatron.model.batching import ENGINE_ROUTES, NO_ROUTE, RoutingReplayError

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

__all__ = [
    "ENGINE_ROUTES",
    "NO_ROUTE",
    "RECORDED_ROUTES",
    "USED_ROUTES",
    "LocalRouter",
    "RouteMode",
    "RoutingReplay",
    "RoutingReplayError",
]

RECORDED_ROUTES = "recorded_routes"
USED_ROUTES = "used_routes"

MicroBatch = MutableMapping[str, torch.Tensor]  # a model.step_batch.MicroBatch or a dict of tensors


class RouteMode(Enum):
    """What one schedule does with the routers."""

    LIVE = "live"  # plain top-k, nothing kept
    RECORD = "record"  # plain top-k, kept in the micro-batch
    REPLAY = "replay"  # top-k indices from the micro-batch


@dataclass(frozen=True)
class LocalRouter:
    """One MoE router of this rank: its global layer index (0-based) and Megatron's replay object."""

    layer: int
    replay: RouterReplay


class RoutingReplay:
    """Drives the ``RouterReplay`` of every MoE router in this rank's model chunks (one pipeline stage).

    Usage per schedule (:meth:`schedule` does the first and last step): :meth:`begin` (mode, keys), then for each
    micro-batch in schedule order :meth:`before_forward` / :meth:`after_forward` around the model call, then
    :meth:`clear` (always, in a ``finally``)."""

    def __init__(self, chunks: Sequence[GPTModel], config: TransformerConfig, num_layers: int) -> None:
        check_supported(config)
        self.routers = local_routers(chunks)
        self.config = config
        self.num_layers = num_layers
        self.top_k = config.moe_router_topk
        self.split_sequence = bool(config.sequence_parallel) and config.tensor_model_parallel_size > 1
        self.seconds = 0.0
        self._moe_layers = [layer.mlp for chunk in chunks for layer in chunk.decoder.layers]
        self._mode = RouteMode.LIVE
        self._key: str | None = None
        self._out_key = RECORDED_ROUTES
        self._recomputes = False

    @property
    def layers(self) -> list[int]:
        """Global indices (0-based) of this stage's MoE layers, in router order."""
        return [router.layer for router in self.routers]

    # ------------------------------------------------------------------ one schedule
    @contextlib.contextmanager
    def schedule(
        self,
        micro_batches: Sequence[MicroBatch],
        mode: RouteMode,
        *,
        key: str | None = None,
        out_key: str = RECORDED_ROUTES,
        backward: bool = True,
    ) -> Iterator[RoutingReplay]:
        """One pipeline schedule under ``mode``: REPLAY reads ``batch[key]``; RECORD writes ``batch[out_key]``
        after each micro-batch's forward; ``backward``: the schedule also runs backwards (recomputation may
        call the routers again). Every router is left clean afterwards, also when the schedule raises."""
        self.begin(micro_batches, mode, key=key, out_key=out_key, backward=backward)
        try:
            yield self
        finally:
            self.clear()

    def begin(
        self,
        micro_batches: Sequence[MicroBatch],
        mode: RouteMode,
        *,
        key: str | None = None,
        out_key: str = RECORDED_ROUTES,
        backward: bool = True,
    ) -> None:
        """Prepare a schedule over ``micro_batches``; REPLAY sources are checked here, for every micro-batch,
        before anything runs."""
        start = time.perf_counter()
        self.clear()
        if mode is RouteMode.REPLAY:
            for index, batch in enumerate(micro_batches):
                self._check_source(batch, key, index)
        self._mode, self._key, self._out_key = mode, key, out_key
        self._recomputes = backward and self._router_recomputed()
        self.seconds += time.perf_counter() - start

    def before_forward(self, batch: MicroBatch) -> None:
        start = time.perf_counter()
        if self._mode is RouteMode.REPLAY:
            assert self._key is not None  # begin() checked the REPLAY source key
            for router, targets in zip(self.routers, self._targets(batch[self._key], batch)):
                router.replay.set_target_indices(targets)  # also queued for REPLAY_BACKWARD
            self._set_action(RouterReplayAction.REPLAY_FORWARD)
        elif self._mode is RouteMode.RECORD:
            self._set_action(RouterReplayAction.RECORD)
        self.seconds += time.perf_counter() - start

    def after_forward(self, batch: MicroBatch) -> None:
        start = time.perf_counter()
        if self._mode is RouteMode.REPLAY and self._recomputes:
            # any router call from now until the next forward is a recomputation in the backward
            self._set_action(RouterReplayAction.REPLAY_BACKWARD)
        elif self._mode is RouteMode.REPLAY:
            # nothing will read the targets again (autograd keeps what the gather's backward needs): drop them
            # rather than keep every micro-batch's int64 indices on the device until the step ends
            self._clear_routers()
        elif self._mode is RouteMode.RECORD:
            # to the CPU now: the device holds one micro-batch's recorded indices at a time
            recorded = [self._take_recorded(router) for router in self.routers]
            batch[self._out_key] = self._assemble(batch, recorded)
            self._set_action(None)  # a recomputation must not record again
        self.seconds += time.perf_counter() - start

    def clear(self) -> None:
        """Forget every target, queued target, recorded index and action of this rank's routers."""
        self._clear_routers()
        self._mode, self._key = RouteMode.LIVE, None

    def _clear_routers(self) -> None:
        for router in self.routers:
            router.replay.clear_indices()
            router.replay.clear_router_replay_action()

    def _router_recomputed(self) -> bool:
        """Will the backward run the routers again? Full-layer recomputation, or MoE-layer recomputation
        (``recompute_modules`` with ``"moe"`` sets ``MoELayer.moe_layer_recompute``)."""
        full = getattr(self.config, "recompute_granularity", None) == "full"
        return full or any(getattr(mlp, "moe_layer_recompute", False) for mlp in self._moe_layers)

    def holds_state(self) -> bool:
        """Does any router still hold targets, queued targets, recorded indices or an action?"""
        return any(
            r.replay.target_topk_idx is not None
            or r.replay.recorded_topk_idx is not None
            or r.replay.replay_backward_list
            or r.replay.router_replay_action is not None
            for r in self.routers
        )

    # ------------------------------------------------------------------ internals
    def _set_action(self, action: RouterReplayAction | None) -> None:
        for router in self.routers:
            if action is None:
                router.replay.clear_router_replay_action()
            else:
                router.replay.set_router_replay_action(action)

    def _check_source(self, batch: MicroBatch, key: str | None, index: int) -> None:
        if key is None or key not in batch:
            raise RoutingReplayError(
                f"micro-batch {index} has no {key!r} to replay (keys: {sorted(batch)})",
                hint="record_routes=True in the old-log-prob pass (R2), or build the micro-batches with "
                "route_layout= from engine routes (R3)",
            )
        routes, ids = batch[key], batch["input_ids"]
        expected = (*ids.shape, self.num_layers, self.top_k)
        if tuple(routes.shape) != expected:
            raise RoutingReplayError(
                f"micro-batch {index}: {key} has shape {list(routes.shape)}, expected {list(expected)}"
            )
        local = routes[:, :, self.layers]
        if local.numel() and int(local.min()) < 0:
            raise RoutingReplayError(
                f"micro-batch {index}: {key} has no route (-1) on some MoE layer of this stage {self.layers}"
            )

    def _targets(self, routes: torch.Tensor, batch: MicroBatch) -> list[torch.Tensor]:
        """Per local router: int64 ``[tokens, k]`` on the model's device, tokens in the router's order (this
        context-parallel rank's chunks, then this tensor-parallel rank's sequence slice, sequence-major)."""
        if not self.routers:
            return []
        routes = shard_tokens(routes, batch_shards(batch))
        start, stop = self._sequence_slice(routes.shape[1])
        local = routes[:, start:stop][:, :, self.layers]  # [b, s_local, n_local, k], int32 on the CPU
        device = self._device()
        local = local.to(device, non_blocking=True).long().permute(2, 1, 0, 3)  # [n_local, s_local, b, k]
        return list(local.reshape(len(self.routers), -1, self.top_k).unbind(0))

    def _take_recorded(self, router: LocalRouter) -> torch.Tensor:
        indices = router.replay.get_recorded_indices()
        if indices is None:
            raise RuntimeError(f"the router of layer {router.layer} recorded nothing in this forward")
        router.replay.clear_indices()
        return indices

    def _assemble(self, batch: MicroBatch, per_layer: list[torch.Tensor]) -> torch.Tensor:
        """``[b, s, L, k]`` int32 CPU from this stage's ``[tokens, k]`` per router (sequence-major tokens; under
        context parallelism this rank's chunks, gathered back into whole sequences)."""
        batch_size, length = batch["input_ids"].shape
        out = torch.full((batch_size, length, self.num_layers, self.top_k), NO_ROUTE, dtype=torch.int32)
        if not per_layer:
            return out
        stacked = torch.stack(per_layer).to(torch.int32).reshape(len(per_layer), -1, batch_size, self.top_k)
        if self.split_sequence:
            stacked = _gather_sequence(stacked)
        out[:, :, self.layers] = gather_tokens(stacked.permute(2, 1, 0, 3), batch_shards(batch)).cpu()
        return out

    def _sequence_slice(self, length: int) -> tuple[int, int]:
        if not self.split_sequence:
            return 0, length
        size = parallel_state.get_tensor_model_parallel_world_size()
        if length % size:
            raise RoutingReplayError(
                f"sequence length {length} is not a multiple of tensor parallel size {size}"
            )
        part = length // size
        rank = parallel_state.get_tensor_model_parallel_rank()
        return rank * part, (rank + 1) * part

    def _device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )


def _gather_sequence(stacked: torch.Tensor) -> torch.Tensor:
    """``[n, s/tp, b, k]`` slices of the tensor-parallel ranks → ``[n, s, b, k]`` (rank order = sequence order)."""
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(stacked) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, stacked.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def local_routers(chunks: Sequence[GPTModel]) -> list[LocalRouter]:
    """This rank's MoE routers with their global layer index (``TransformerLayer.layer_number`` is 1-based and
    already includes the pipeline offset), in layer order."""
    routers = []
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if not isinstance(router, TopKRouter):
                continue
            if router.router_replay is None:
                raise RoutingReplayError(
                    "the model was built without moe_enable_routing_replay; build it with routing_replay=True"
                )
            if getattr(router, "routing_type", None) in ("sinkhorn", "quantile_balancing"):
                raise RoutingReplayError(
                    f"routing replay does not reach {router.routing_type} routing (Megatron skips it there)"
                )
            routers.append(LocalRouter(layer.layer_number - 1, router.router_replay))
    return routers


def check_supported(config: TransformerConfig) -> None:
    """Refuse models and layouts where Megatron's replay is absent, silently skipped, or misaligned."""
    if not config.num_moe_experts:
        raise RoutingReplayError(
            "routing replay needs an MoE model; this one has no MoE layers (nothing to replay)",
            hint="set algorithm.routing_replay: none",
        )
    problems = []
    if not config.moe_enable_routing_replay:
        problems.append("the model was built without moe_enable_routing_replay")
    if getattr(config, "moe_router_fusion", False):
        problems.append("moe_router_fusion: Megatron's fused router returns before replay is consulted")
    if config.virtual_pipeline_model_parallel_size:
        problems.append("virtual pipeline stages: backward order differs from forward order")
    if getattr(config, "mtp_num_layers", None):
        problems.append("multi-token prediction: MTP routers have no engine routes and share layer numbers")
    if problems:
        raise RoutingReplayError("routing replay is not supported here: " + "; ".join(problems))
