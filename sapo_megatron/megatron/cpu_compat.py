"""Run Megatron-Core on CPU over gloo (development, tests, the embedded demo).

Megatron-Core assumes CUDA in a few dozen places. Rather than forking it, this module applies a small set of
runtime patches, and only when ``torch.cuda.is_available()`` is False – on a GPU machine nothing here runs.

Call :func:`apply` once, before building a model. It is idempotent. What it patches and why:

1. ``device="cuda"`` / ``pin_memory=True`` hard-coded in tensor factories and ``.cuda()`` / ``.to("cuda")``
   calls (schedules, optimizer, transformer utils, MoE): a torch function mode rewrites the device to CPU
   and drops pinning.
2. ``torch.cuda.current_device()`` (rotary embeddings, optimizer, checkpointing): returns the CPU device.
3. CUDA streams, events, NVTX ranges and ``torch.cuda.synchronize`` (token dispatcher, timers): no-ops.
4. The tensor-parallel RNG tracker (``tensor_parallel/random.py``) forks the CPU generator instead of CUDA's.
5. ``Tensor.type()`` is compared with CUDA type names (grad clipping asserts ``torch.cuda.FloatTensor``;
   the optimizers sort parameters into fp32/bf16 groups by it): the mode reports CPU tensors under the
   ``torch.cuda.*`` names.
6. MoE all-to-all split sizes (``moe_utils``/token dispatcher) arrive as tensors; gloo needs Python lists.
7. MoE with TP>1 needs sequence parallel, and the plain torch RMSNorm must mark its weight for the
   sequence-parallel gradient all-reduce (``torch_norm.py``).
8. megatron-core 0.16.x only: ``moe_utils.te_general_gemm`` is undefined without Transformer Engine.
9. megatron-core 0.19.x only: ``moe/ops/paged_stash.py`` imports triton unconditionally; a stub module is
   registered for that single module (a fake top-level ``triton`` would break torch itself).
10. ``megatron/core/jit.py`` makes ``torch.compile`` its ``jit_fuser``, and a dozen functions (activations, the
   router's expert-bias update, the dispatcher's preprocessing) are decorated with it at import: that imports
   torch's compiler stack (about 1.2 s of CPU per process) for kernels fused for GPUs. Without CUDA, Megatron is
   imported with ``torch.compile`` standing in as the identity and its ``jit_fuser`` then disabled, so these
   functions run eagerly (:func:`import_megatron_eagerly`, called by ``sapo_megatron.megatron`` on import).

Not a patch, but the same purpose: context parallelism (``parallel.cp > 1``) lives in Transformer Engine's
attention, which CPUs do not have; the layer spec then uses
:class:`~sapo_megatron.megatron.context_parallel.ContextParallelAttention`, a documented stand-in
(docs/context_parallel.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from typing import Any, overload

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_MODE: TorchFunctionMode | None = None


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU and drops ``pin_memory`` (patch 1)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            return result.replace("torch.", "torch.cuda.", 1)  # patch 5: CUDA type names expected
        return result


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` / ``Event`` (patch 3): one shared no-op object, so that
    "is this the current stream" checks hold and ``record_event()`` returns something to synchronize on."""

    _instance: _NullStream | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> _NullStream:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self

    def query(self) -> bool:
        return True

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _patch_torch_cuda() -> None:
    """Patches 2 and 3: device queries, streams, events, NVTX and synchronisation."""
    cuda: Any = torch.cuda  # its typed functions and classes are replaced on purpose
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda *args, **kwargs: None
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.current_stream = lambda *args, **kwargs: _NullStream()
    cuda.default_stream = lambda *args, **kwargs: _NullStream()
    cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    cuda.nvtx.range_push = lambda *args, **kwargs: None
    cuda.nvtx.range_pop = lambda *args, **kwargs: None
    cuda.nvtx.range = lambda *args, **kwargs: contextlib.nullcontext()
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *args, **kwargs: 0
    cuda.max_memory_allocated = lambda *args, **kwargs: 0


class _CpuRNGStatesTracker:
    """Tensor-parallel RNG tracker over the CPU generator (patch 4).

    Same interface as ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker``: named states, each forked
    in and out of the one default CPU generator.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"RNG state {name!r} / seed {seed} already exists")
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"RNG state {name!r} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.CudaRNGStatesTracker = _CpuRNGStatesTracker
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    tp_random.initialize_rng_tracker(force_reset=True)


def _patch_moe_utils() -> None:
    """Patch 8: 0.16.x references ``te_general_gemm`` without defining it when TE is absent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@overload
def _as_int_list(sizes: None) -> None: ...
@overload
def _as_int_list(sizes: Any) -> list[int]: ...
def _as_int_list(sizes: Any) -> list[int] | None:
    return (
        None if sizes is None else [int(v) for v in (sizes.tolist() if hasattr(sizes, "tolist") else sizes)]
    )


def _mark_patched(fn: Any) -> None:
    """Mark a replacement so that a second ``apply()`` sees the patch in place."""
    fn.__dict__["_sapo_patched"] = True


def _patch_all_to_all() -> None:
    """Patch 6: the token dispatcher passes numpy / tensor split sizes, which gloo's all_to_all rejects."""
    from megatron.core.tensor_parallel import mappings

    forward = mappings._AllToAll.forward
    if getattr(forward, "_sapo_patched", False):
        return

    def patched(ctx, group, input, output_split_sizes, input_split_sizes, *rest):
        return forward(
            ctx, group, input, _as_int_list(output_split_sizes), _as_int_list(input_split_sizes), *rest
        )

    _mark_patched(patched)
    mappings._AllToAll.forward = staticmethod(patched)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded


def _patch_uneven_collectives() -> None:
    """Patch 6 (continued): with expert tensor parallelism the dispatcher all-gathers / reduce-scatters
    per-rank token counts that differ; gloo only does equal sizes, so pad to the largest and slice."""
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    if getattr(gather, "_sapo_patched", False):
        return

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = _as_int_list(output_split_sizes)
        rows = max(sizes)
        chunks = gather(_pad_rows(input_, rows), group).split(rows)
        return torch.cat([chunk[:size] for chunk, size in zip(chunks, sizes)])

    def scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = _as_int_list(input_split_sizes)
        rows = max(sizes)
        padded = torch.cat([_pad_rows(piece, rows) for piece in input_.split(sizes)])
        return scatter(padded, group)[: sizes[group.rank()]]

    _mark_patched(gather_uneven)
    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = scatter_uneven


def _patch_torch_norm() -> None:
    """Patch 7: the local-spec norm refuses sequence parallelism; build it anyway and mark its weight so that
    ``finalize_model_grads`` all-reduces its gradient over the TP group, as TE's norm does."""
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__
    if getattr(original_new, "_sapo_patched", False):
        return

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    _mark_patched(new)
    torch_norm.WrappedTorchNorm.__new__ = new


_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


def _unavailable_kernel(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("paged-stash kernels need triton (GPU); they are not available on this machine")


def register_import_stubs() -> None:
    """Patch 9 (megatron-core >= 0.19): ``moe/ops/paged_stash.py`` imports triton at import time, and GPTModel
    imports it. Without triton, register a stand-in for that one module (its kernels raise if ever called).
    Must run before ``megatron.core.models`` is imported; a no-op when triton is installed."""
    if _PAGED_STASH_OPS in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(_PAGED_STASH_OPS)
    vars(stub).update(
        GLOBAL_BLOCK_SIZE=1024,
        paged_stash_copy_kernel=_unavailable_kernel,
        paged_stash_pop_kernel=_unavailable_kernel,
        __all__=["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"],
    )
    sys.modules[_PAGED_STASH_OPS] = stub


def _identity_compile(model: Any = None, **kwargs: Any) -> Any:
    """``torch.compile`` as the identity, as a decorator with and without arguments."""
    return model if model is not None else (lambda fn: fn)


def import_megatron_eagerly() -> None:
    """Patch 10: import ``megatron.core`` without ``torch.compile`` (no-op with CUDA, or once imported)."""
    if torch.cuda.is_available() or "megatron.core" in sys.modules:
        return
    real_compile = torch.compile
    torch.compile = _identity_compile
    try:
        import megatron.core  # noqa: F401 - the import is the point
        from megatron.core import jit
    finally:
        torch.compile = real_compile
    jit.jit_fuser = jit.noop_decorator  # functions decorated later (inside constructors) run eagerly too


def apply() -> bool:
    """Apply the CPU patches once; returns True if they are active (no CUDA), False on a GPU machine."""
    global _APPLIED, _MODE
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_moe_utils()
    _patch_torch_norm()
    _patch_all_to_all()
    _patch_uneven_collectives()
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _APPLIED = True
    return True
