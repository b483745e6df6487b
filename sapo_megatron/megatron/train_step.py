"""A training-step API over Megatron-Core: ``get_forward_backward_func`` + Megatron DDP + the Megatron optimizer.

The caller hands over this rank's micro-batches and a loss function; the engine runs the pipeline schedule,
reduces gradients, clips, steps the optimizer and the LR schedule, and returns reduced metrics.

Loss convention (why it looks the way it does): a loss function returns this micro-batch's *contribution to the
global objective* – already divided by a global normaliser (all micro-batches, all data-parallel ranks) – so the
sum of contributions is the loss, whatever the micro-batch split or the layout. Megatron averages a 2-tuple loss
over micro-batches and DDP averages gradients over data-parallel ranks; the engine pre-multiplies by both counts
to undo that averaging exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from sapo_megatron.checkpoint.hf_io import HFCheckpointReader
from sapo_megatron.config import OptimizerConfig, RunConfig
from sapo_megatron.megatron.model import BuildOptions, build_gpt_model, fp8_ddp_fields, fp8_optimizer_fields
from sapo_megatron.megatron.packed_seq import model_inputs
from sapo_megatron.megatron.routing import reduce_agreement
from sapo_megatron.megatron.routing_replay import (
    RECORDED_ROUTES,
    USED_ROUTES,
    RouteMode,
    RoutingReplay,
    RoutingReplayError,
)
from sapo_megatron.megatron.weights import load_hf_weights
from sapo_megatron.model.step_batch import MicroBatch

# One micro-batch (:class:`~sapo_megatron.model.step_batch.MicroBatch`; a plain dict of tensors works too), read
# here through its mapping view: ``input_ids`` [b, s] (right-padded), optional ``position_ids`` [b, s], whatever
# the loss function reads, and MoE routes int32 [b, s, L, k] (``engine_routes``, ``recorded_routes``,
# ``used_routes``: see :mod:`sapo_megatron.megatron.routing_replay`). Packed micro-batches (``segment_ids``; one row
# [1, T], :mod:`sapo_megatron.model.packing`) run as THD or with a block mask (:mod:`sapo_megatron.megatron.packed_seq`).

Metrics = dict[str, torch.Tensor]
"""Metric name → 2-element tensor ``(weighted_sum, weight)``; the engine sums both over micro-batches and
data-parallel ranks and reports ``weighted_sum / weight``."""


class TaggedMetrics(dict[str, torch.Tensor]):
    """:data:`Metrics` that also name their per-update diagnostics (``per_update``), which the engine hands on in
    :attr:`StepResult.per_update` on every rank (the last pipeline stage knows them)."""

    def __init__(self, values: Metrics | None = None, per_update: frozenset[str] = frozenset()) -> None:
        super().__init__(values or {})
        self.per_update = per_update


LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, Metrics]]
"""``(vocab_parallel_logits [b, s, V/tp], batch) -> (loss contribution, metrics)``, run on the last stage."""

OutputFn = Callable[[torch.Tensor, MicroBatch], torch.Tensor]
"""Forward-only: ``(vocab_parallel_logits, batch) -> per-micro-batch result`` (e.g. log-probs [b, s])."""


@dataclass
class StepResult:
    """What one optimizer step reports (identical on every rank)."""

    loss: float
    grad_norm: float
    lr: float
    update_successful: bool
    metrics: dict[str, float] = field(default_factory=dict)
    metric_sums: dict[str, tuple[float, float]] = field(default_factory=dict)
    """``metrics`` before division: ``(weighted sum, weight)`` over every micro-batch and rank, to pool several
    optimizer steps exactly (:class:`sapo_megatron.loop.step_metrics.StepMetrics`)."""
    per_update: frozenset[str] = frozenset()
    """The metrics the loss marked as per-update diagnostics (:class:`TaggedMetrics`)."""


class TrainEngine:
    """Model chunks wrapped in Megatron DDP, the Megatron optimizer and its LR schedule, for one rank.

    ``routing_replay=True`` builds the MoE routers with Megatron's ``RouterReplay`` (refused with a
    :class:`RoutingReplayError` for models / layouts it cannot serve) and enables ``record_routes`` and
    ``replay_key``; without them the routers behave exactly as without replay."""

    def __init__(
        self, cfg: RunConfig, *, routing_replay: bool = False, total_steps: int | None = None
    ) -> None:
        self.cfg = cfg
        opts = BuildOptions(cfg.model, cfg.parallel, cfg.precision, routing_replay=routing_replay)
        module = build_gpt_model(opts)
        self.routes = (
            RoutingReplay([module], module.config, cfg.model.arch.num_hidden_layers)
            if routing_replay
            else None
        )
        init_weights(module, cfg)
        self.config = module.config
        self.model = [_wrap_ddp(module, cfg)]
        self.optimizer = get_megatron_optimizer(_megatron_optimizer_config(cfg), self.model)
        self.scheduler = _build_scheduler(self.optimizer, cfg.optimizer, total_steps)
        self._wire_config()

    def _wire_config(self) -> None:
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.no_sync_func = self.model[0].no_sync

    def reset_schedule(self, *, lr: float, total_steps: int, done: int = 0) -> None:
        """A fresh LR schedule (same style as configured) peaking at ``lr`` over ``total_steps`` optimizer steps,
        fast-forwarded by ``done`` steps (phases such as the SFT warm start use their own rate; resume)."""
        opt = self.cfg.optimizer.model_copy(update={"lr": lr, "min_lr": min(self.cfg.optimizer.min_lr, lr)})
        self.set_lr_bounds(opt.lr, opt.min_lr)
        self.scheduler = _build_scheduler(self.optimizer, opt, total_steps)
        if done:
            self.scheduler.step(increment=done)

    def lr_bounds(self) -> tuple[float, float]:
        """``(max_lr, min_lr)`` of the current schedule, as the optimizer's parameter groups hold them."""
        group = self.optimizer.param_groups[0]
        return float(group["max_lr"]), float(group["min_lr"])

    def set_lr_bounds(self, max_lr: float, min_lr: float) -> None:
        """Set every parameter group's ``max_lr`` / ``min_lr`` (Megatron's scheduler reads them; megatron-core
        0.19 also matches a checkpoint's parameter groups by them, so a load needs those of the save)."""
        for group in self.optimizer.param_groups:
            group["max_lr"], group["min_lr"] = max_lr, min_lr

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped GPTModel of this rank."""
        return self.model[0].module

    def train_step(
        self,
        micro_batches: Sequence[MicroBatch],
        loss_fn: LossFn,
        *,
        replay_key: str | None = None,
        record_routes: bool = False,
    ) -> StepResult:
        """Forward + backward over this rank's micro-batches, then one optimizer and LR-schedule step.

        ``replay_key`` (e.g. ``"recorded_routes"`` for R2, ``"engine_routes"`` for R3): every MoE router of this
        stage uses ``batch[replay_key]``'s experts in the forward and in any recomputation; gate weights stay the
        softmax of the live router logits over those experts. ``record_routes``: each micro-batch gets
        ``used_routes``, the experts the training forward used (the replay source, or the live top-k)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        # CP: the schedule multiplies a 2-tuple loss by cp and DDP divides the gradients by dp·cp (its dp_cp
        # group), which cancel (megatron-core 0.16.1 schedules.forward_step_calc_loss, distributed_data_parallel)
        scale = len(micro_batches) * parallel_state.get_data_parallel_world_size()
        loss_fn = partial(_scaled_loss, loss_fn, scale)
        mode = RouteMode.REPLAY if replay_key else RouteMode.RECORD if record_routes else RouteMode.LIVE
        with self._route_schedule(micro_batches, mode, replay_key, USED_ROUTES) as routes:
            losses, metrics = _run_schedule(self.model, micro_batches, loss_fn, False, routes)
        if replay_key and record_routes:
            for batch in micro_batches:
                batch[USED_ROUTES] = batch[replay_key]
        if _all_finite(self.model, losses):
            update_successful, grad_norm, _ = self.optimizer.step()
        else:  # a non-finite loss or gradient anywhere: skip the update on every rank (weights stay as they were)
            update_successful, grad_norm = False, float("nan")
        if update_successful:
            self.scheduler.step(increment=1)
        loss, sums, per_update = _reduce_metrics(losses, metrics)
        return StepResult(
            loss=loss,
            grad_norm=float("nan")
            if grad_norm is None and not update_successful
            else float(grad_norm or 0.0),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            update_successful=bool(update_successful),
            metrics={name: total / max(weight, 1e-12) for name, (total, weight) in sums.items()},
            metric_sums=sums,
            per_update=per_update,
        )

    def forward_only(
        self,
        micro_batches: Sequence[MicroBatch],
        output_fn: OutputFn,
        *,
        record_routes: bool = False,
        replay_key: str | None = None,
    ) -> list[torch.Tensor] | None:
        """Run the model without gradients; returns ``output_fn``'s result per micro-batch on the last
        pipeline stage, ``None`` on the other stages. ``record_routes``: every micro-batch (on every stage)
        gets ``recorded_routes``, int32 ``[b, s, L, k]`` with this stage's MoE layers filled, ``-1`` elsewhere.
        ``replay_key``: the routers use ``batch[replay_key]``'s experts (R3's old-log-prob pass)."""
        if record_routes and replay_key:
            raise RoutingReplayError("forward_only: record_routes and replay_key exclude each other")
        mode = RouteMode.REPLAY if replay_key else RouteMode.RECORD if record_routes else RouteMode.LIVE
        with self._route_schedule(micro_batches, mode, replay_key, RECORDED_ROUTES, backward=False) as routes:
            return run_forward_only(self.model, micro_batches, output_fn, routes)

    def routing_agreement(
        self, micro_batches: Sequence[MicroBatch], key_a: str, key_b: str, mask_key: str = "loss_mask"
    ) -> tuple[float, list[float]]:
        """Fraction of token-layers whose top-k expert sets agree between ``batch[key_a]`` and ``batch[key_b]``
        over the positions where ``batch[mask_key] > 0`` (default: those predicting response tokens) and the MoE
        layers, summed over micro-batches, data-parallel ranks and pipeline stages: ``(overall, per layer)``,
        identical on every rank; the per-layer list has ``num_hidden_layers`` entries, NaN for dense layers."""
        if self.routes is None:
            raise RoutingReplayError("routing agreement needs TrainEngine(..., routing_replay=True)")
        missing = sorted(
            {key for batch in micro_batches for key in (key_a, key_b, mask_key) if key not in batch}
        )
        if missing:
            raise RoutingReplayError(f"routing agreement: micro-batches without {', '.join(missing)}")
        return reduce_agreement(micro_batches, key_a, key_b, self.routes.layers, mask_key)

    def take_route_seconds(self) -> float:
        """Seconds spent laying out, setting, recording and gathering routes since the last call."""
        if self.routes is None:
            return 0.0
        seconds, self.routes.seconds = self.routes.seconds, 0.0
        return seconds

    @contextlib.contextmanager
    def _route_schedule(
        self,
        micro_batches: Sequence[MicroBatch],
        mode: RouteMode,
        key: str | None,
        out_key: str,
        *,
        backward: bool = True,
    ) -> Iterator[RoutingReplay | None]:
        if mode is RouteMode.LIVE:
            yield None
            return
        if self.routes is None:
            raise RoutingReplayError(
                "record_routes / replay_key need the engine built with TrainEngine(..., routing_replay=True)"
            )
        with self.routes.schedule(micro_batches, mode, key=key, out_key=out_key, backward=backward) as routes:
            yield routes

    def snapshot(self) -> ReferenceModel:
        """A frozen copy of the current weights (same layout), e.g. the reference policy of a KL penalty."""
        with torch.random.fork_rng(devices=[]):  # building initialises weights: leave the RNG streams alone
            module = build_gpt_model(BuildOptions(self.cfg.model, self.cfg.parallel, self.cfg.precision))
        module.load_state_dict(self.module.state_dict())
        return ReferenceModel(module)


class ReferenceModel:
    """A model chunk without gradients or optimizer: forward-only passes (reference log-probs)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module.requires_grad_(False).eval()

    def forward_only(
        self, micro_batches: Sequence[MicroBatch], output_fn: OutputFn
    ) -> list[torch.Tensor] | None:
        return run_forward_only([self.module], micro_batches, output_fn)


@torch.no_grad()
def run_forward_only(
    model: list[torch.nn.Module],
    micro_batches: Sequence[MicroBatch],
    output_fn: OutputFn,
    routes: RoutingReplay | None = None,
) -> list[torch.Tensor] | None:
    """Forward passes in eval mode; ``output_fn``'s result per micro-batch on the last pipeline stage, else None."""
    modes = [chunk.training for chunk in model]
    for chunk in model:
        chunk.eval()
    try:
        outputs, _ = _run_schedule(model, micro_batches, partial(_collect_output, output_fn), True, routes)
    finally:
        for chunk, mode in zip(model, modes):
            chunk.train(mode)
    return outputs if parallel_state.is_pipeline_last_stage() else None


def _run_schedule(
    model: list[torch.nn.Module],
    micro_batches: Sequence[MicroBatch],
    loss_fn,
    forward_only: bool,
    routes: RoutingReplay | None = None,
):
    if not micro_batches:
        raise ValueError("train_step/forward_only need at least one micro-batch")
    shape = micro_batches[0]["input_ids"].shape
    store = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, loss_fn, routes),
        data_iterator=iter(micro_batches),
        model=model,
        num_microbatches=len(micro_batches),
        seq_length=shape[1],
        micro_batch_size=shape[0],
        forward_only=forward_only,
    )
    if not parallel_state.is_pipeline_last_stage():
        return [], []
    return [item[0] for item in store], [item[1] for item in store]


def init_weights(module: torch.nn.Module, cfg: RunConfig) -> None:
    """Load initial weights before DDP and the optimizer exist (so bf16 main params start from them)."""
    path = cfg.model.init_path
    if cfg.model.init == "random":
        return
    if path is None:  # ModelConfig requires it
        raise ValueError(f"model.init={cfg.model.init} needs model.init_path")
    if cfg.model.init == "hf":
        reader = HFCheckpointReader(path)
        reader.validate(cfg.model.arch)
        load_hf_weights(module, reader.get, cfg.model.arch)
    elif cfg.model.init == "megatron":
        from sapo_megatron.megatron.dist_ckpt import load_model_weights

        load_model_weights(module, path)


def _forward_step(loss_fn, routes: RoutingReplay | None, data_iterator: Iterator[MicroBatch], model):
    """One micro-batch's forward, in schedule order: the routers get this micro-batch's routes just before it
    (and switch to recomputation replay right after)."""
    batch = next(data_iterator)
    if routes is not None:
        routes.before_forward(batch)
    with model_inputs(model, batch) as inputs:  # packed micro-batches: THD or block mask + per-sequence RoPE
        logits = model(inputs.pop("input_ids", batch["input_ids"]), **inputs)  # CP: this rank's tokens
    if routes is not None:
        routes.after_forward(batch)
    return logits, partial(loss_fn, batch)


def _scaled_loss(loss_fn: LossFn, scale: int, batch: MicroBatch, logits: torch.Tensor):
    """Megatron divides a 2-tuple loss by the micro-batch count and DDP averages over DP ranks: undo both."""
    loss, metrics = loss_fn(logits, batch)
    return loss * scale, (loss.detach(), metrics)


def _collect_output(output_fn: OutputFn, batch: MicroBatch, logits: torch.Tensor):
    result = output_fn(logits, batch)
    return torch.zeros((), device=logits.device), (result, None)


def _all_finite(model: list[torch.nn.Module], losses: list[torch.Tensor]) -> bool:
    """Collective over every rank: are this step's loss contributions and reduced gradients all finite?

    Megatron's optimizers step on non-finite gradients in bf16/fp32 (only fp16 loss scaling checks them) and
    DDP's own NaN check is fatal; checking here lets the trainer skip the update and count it instead."""
    device = next(model[0].parameters()).device
    finite = torch.ones((), dtype=torch.bool, device=device)
    for tensor in [*losses, *_grad_tensors(model)]:
        finite &= torch.isfinite(tensor).all()  # stays on the device: one host sync below, not one per tensor
    flag = finite.to(torch.float32).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def _grad_tensors(model: list[torch.nn.Module]) -> list[torch.Tensor]:
    """The gradients as DDP holds them: its contiguous buffers (a few large tensors), else ``param.grad``."""
    grads = []
    for chunk in model:
        # DDP's lists of buffers (a plain nn.Module's ``buffers`` is a method: not that)
        buffers = [
            buffer
            for name in ("buffers", "expert_parallel_buffers")
            if isinstance(getattr(chunk, name, None), list)
            for buffer in getattr(chunk, name)
        ]
        if buffers:
            grads += [buffer.grad_data for buffer in buffers]
        else:
            grads += [p.grad for p in chunk.parameters() if p.grad is not None]
    return grads


def _reduce_metrics(
    losses: list[torch.Tensor], metrics: list[Metrics]
) -> tuple[float, dict[str, tuple[float, float]], frozenset[str]]:
    """Sum loss contributions and ``(weighted_sum, weight)`` metrics over micro-batches, DP ranks, and
    broadcast from the last pipeline stage so that every rank returns the same numbers; the per-update names."""
    tagged = frozenset(n for m in metrics if isinstance(m, TaggedMetrics) for n in m.per_update)
    names, per_update = _metric_names_from_last_stage(sorted(metrics[0]) if metrics else [], tagged)
    packed = torch.zeros(1 + 2 * len(names), dtype=torch.float64)
    if losses:
        packed[0] = sum(float(x) for x in losses)
        for i, name in enumerate(names):
            packed[1 + 2 * i : 3 + 2 * i] = torch.stack([m[name].double().cpu() for m in metrics]).sum(0)
    packed = _broadcast_from_last_stage(packed)
    dist.all_reduce(packed, group=parallel_state.get_data_parallel_group())
    sums = {n: (float(packed[1 + 2 * i]), float(packed[2 + 2 * i])) for i, n in enumerate(names)}
    return float(packed[0]), sums, per_update


def _metric_names_from_last_stage(
    names: list[str], per_update: frozenset[str]
) -> tuple[list[str], frozenset[str]]:
    """Pipeline: only the last stage ran the loss function, so only it knows the metric names (and which are
    per-update diagnostics)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return names, per_update
    box: list[tuple[list[str], frozenset[str]]] = [(names, per_update)]
    dist.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]


def _broadcast_from_last_stage(packed: torch.Tensor) -> torch.Tensor:
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            packed,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    return packed


def _wrap_ddp(module: torch.nn.Module, cfg: RunConfig) -> DistributedDataParallel:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        **fp8_ddp_fields(cfg.precision),
    )
    return DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)


def _megatron_optimizer_config(cfg: RunConfig) -> MegatronOptimizerConfig:
    opt = cfg.optimizer
    bf16 = cfg.precision.dtype in ("bf16", "fp8")
    return MegatronOptimizerConfig(
        optimizer=opt.name,
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=opt.use_distributed_optimizer,
        **fp8_optimizer_fields(cfg.precision),
    )


def _build_scheduler(optimizer, opt: OptimizerConfig, total_steps: int | None) -> OptimizerParamScheduler:
    decay_steps = opt.decay_steps or max(total_steps or 1, opt.warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if opt.warmup_steps else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=opt.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=opt.decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
