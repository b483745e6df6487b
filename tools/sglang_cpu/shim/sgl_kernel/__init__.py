"""Plain-torch stand-ins for the two ``sgl_kernel`` CPU kernels that SGLang's CPU engine calls for a small dense or
MoE model, so that the real SGLang server runs on a CPU machine without the (CUDA-only) ``sglang-kernel`` wheel.

For the test tier only (``tools/sglang_cpu/serve.sh``, docs/cluster.md). Checked against SGLang 0.5.23:

- ``copy_all_layer_kv_cache_cpu``: imported at ``sglang/kernels/ops/kvcache/cache_move.py:10``
  (``if _is_cpu: from sgl_kernel import copy_all_layer_kv_cache_cpu``), called by ``copy_all_layer_kv_cache_func``
  (same file, line 191) when the KV pool warms up and moves slots (``srt/mem_cache/memory_pool.py``
  ``_init_kv_copy_and_warmup``);
- ``assign_req_to_token_pool_cpu``: imported at ``sglang/srt/mem_cache/allocation.py:46``, called by
  ``assign_req_to_token_pool_func`` (line 746) on every prefill; it does what the Triton kernel
  ``assign_req_to_token_pool`` (line 692) does.

Every other name is a placeholder (module ``__getattr__``): SGLang imports many ``*_cpu`` kernels at module level
on its CPU path (e.g. speculative decoding's ``build_tree_kernel_efficient_cpu`` in
``kernels/ops/speculative/spec_tree.py:40``) that a plain generation never calls; calling one raises, naming it.

``qwen_ops`` registers four ``torch.ops.sgl_kernel.*_cpu`` ops in plain torch, which the Qwen-VL processors need
to load (see there).

Leaving ``torch.ops.sgl_kernel.convert_weight_packed`` unregistered makes ``_is_intel_amx_backend_available``
(``srt/utils/common.py:354``) false, which keeps SGLang on its plain-torch layers instead of the AMX kernels.
"""

from __future__ import annotations

import ctypes

import torch

if torch.cuda.is_available():
    raise ImportError(
        "tools/sglang_cpu/shim is for CPU-only test machines; on a machine with CUDA install the real sglang-kernel "
        "and take tools/sglang_cpu/shim off PYTHONPATH"
    )


from sgl_kernel import qwen_ops  # noqa: F401 - registers the torch.ops the Qwen-VL processors look up


def _rows(address: int, num_rows: int, row_bytes: int) -> torch.Tensor:
    """A ``[num_rows, row_bytes]`` uint8 view of host memory at ``address`` (a KV buffer SGLang allocated)."""
    buffer = (ctypes.c_uint8 * (num_rows * row_bytes)).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(num_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer ``i`` (one per layer and K/V) copy slot ``src_loc[j]`` to slot ``tgt_loc[j]``; a slot is
    ``strides[i]`` bytes (the Triton kernel ``copy_all_layer_kv_cache_tiled`` in cache_move.py does the same)."""
    if tgt_loc.numel() == 0:
        return
    num_rows = int(torch.maximum(tgt_loc.max(), src_loc.max()).item()) + 1
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        rows = _rows(int(address), num_rows, int(row_bytes))
        rows[tgt_loc.long()] = rows[src_loc.long()].clone()


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[sum(lengths[:i]) : ...]``."""
    del pool_len  # the row length of req_to_token, which the tensor already knows
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        length = int(end) - int(start)
        req_to_token[int(row), int(start) : int(end)] = out_cache_loc[offset : offset + length]
        offset += length


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU stand-in in tools/sglang_cpu/shim (SGLang called it on this path)"
        )

    missing.__name__ = name
    return missing
