"""Measure the activation memory of one forward + backward of the model this rank builds, to check the planner's
formula (``sapo_megatron/plan/activations.py``) against: ``bench/bench_planner.py``, the tests, and
``tools/gpu_check.py`` on CUDA.

Three numbers, all for one micro-batch of ``input_ids`` [b, s] through the model and the vocab-parallel log-prob
kernel of the loss (``sum(logp)`` as the objective):

- ``saved``: bytes of the distinct tensors autograd keeps for the backward at the end of the forward (storages
  seen by a saved-tensors hook, parameters excluded) – what the formula counts;
- ``live_after_forward``: bytes the allocator handed out during the forward and still holds at its end;
- ``peak``: the allocator's peak during forward + backward above the level before the forward.

On CPU the allocator is followed through the torch profiler's memory events (every CPU allocation and free,
``profile_memory=True``); on CUDA through ``torch.cuda.max_memory_allocated``. A warm-up step runs first so
that parameter gradients exist (the backward then accumulates into them in place).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd import Variable

from sapo_megatron.megatron.logprobs import vocab_parallel_logprobs


@dataclass(frozen=True)
class MeasuredActivations:
    saved: int
    live_after_forward: int
    peak: int


def measure_activations(
    model: torch.nn.Module, input_ids: torch.Tensor, *, measure_peak: bool = True
) -> MeasuredActivations:
    """One measured forward + backward of ``model`` (a Megatron GPTModel chunk of a single-stage layout) on
    ``input_ids`` [b, s]; gradients accumulate into the parameters. ``measure_peak=False`` skips the allocator
    (the profiler is slow on CPU): ``live_after_forward`` and ``peak`` are then 0."""
    model.train()
    _step(model, input_ids)  # warm-up: gradients allocated, lazy buffers (rope tables, ...) built
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in params:
            saved.setdefault(ptr, tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        box: list[torch.Tensor] = []
        live_after_forward, forward_peak = _allocated(
            lambda: box.append(_forward(model, input_ids)), measure_peak
        )
    _, backward_peak = _allocated(lambda: _backward(box.pop()), measure_peak)
    peak = max(forward_peak, live_after_forward + backward_peak)
    return MeasuredActivations(sum(saved.values()), live_after_forward, peak)


def _forward(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    logits = model(input_ids, positions, attention_mask=None)
    logp, _ = vocab_parallel_logprobs(logits, input_ids, with_entropy=False)
    return logp.float().sum()


def _backward(objective: torch.Tensor) -> None:
    # Megatron's schedules call the engine directly (custom_backward); on CPU that keeps the compatibility
    # mode active during recomputation, which Tensor.backward() would not.
    Variable._execution_engine.run_backward(
        tensors=(objective,),
        grad_tensors=(torch.ones_like(objective),),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _step(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    _backward(_forward(model, input_ids))


def _allocated(fn, measure: bool = True) -> tuple[int, int]:
    """Run ``fn``; return (bytes allocated and not freed, peak bytes above the start) over its run."""
    if not measure:
        fn()
        return 0, 0
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return live, peak
