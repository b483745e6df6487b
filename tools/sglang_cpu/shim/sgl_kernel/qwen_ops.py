"""Plain-torch ``torch.ops.sgl_kernel.*_cpu`` ops that SGLang 0.5.23 looks up when its Qwen-VL processors load.

``srt/multimodal/processors/qwen_vl.py:31`` imports ``srt/models/qwen3_5.py``, which reads four ops at module level
on the CPU (``qwen3_5.py:284``, ``:292``, ``:294``, ``:297``). Without them the import fails, the Qwen-VL processor
never registers, and a Qwen3-VL server stops with "No processor registered for architecture". A Qwen3-VL(-MoE)
model never calls them (they belong to Qwen3.5's gated attention and linear attention); they are written from the
reference paths SGLang has for other devices, and their shapes follow SGLang's own fake registrations
(``srt/model_executor/cpu_graph_runner.py:188``, ``:217``, ``:221``, ``:538``).
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")


def _gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``GemmaRMSNorm.forward_native`` (``srt/layers/layernorm.py:1152``): fp32, scaled by ``1 + weight``."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def fused_sigmoid_mul_cpu(x: torch.Tensor, gate: torch.Tensor) -> None:
    """``x *= sigmoid(gate)`` in place, in fp32: ``kernels/ops/elementwise/elementwise.py:53`` (its Triton kernel,
    line 14, reads the gate per head with its own strides: here reshaped to ``x``)."""
    x.copy_((x.float() * torch.sigmoid(gate.reshape(x.shape).float())).to(x.dtype))


def fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps: float, head_dim: int):
    """Per-head Gemma RMSNorm of q and k: the ``else`` branch at ``srt/models/qwen3_5.py:1455``."""
    return (
        _gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps).view_as(q),
        _gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps).view_as(k),
    )


def fused_qk_gemma_rmsnorm_with_gate_cpu(
    q_gate, k, q_weight, k_weight, eps: float, head_dim: int, num_head: int
):
    """Split each head of ``q_gate`` into q and gate halves (``forward_prepare_native``, ``qwen3_5.py:1500``), norm
    q and k per head; returns q ``[seq*heads, head_dim]``, k ``[seq*kv_heads, head_dim]``, gate like q."""
    seq = q_gate.shape[0]
    q, gate = torch.chunk(q_gate.view(seq, num_head, 2 * head_dim), 2, dim=-1)
    q_out = _gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps)
    k_out = _gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps)
    return q_out, k_out, gate.reshape(-1, head_dim).contiguous()


def fused_qkvzba_split_reshape_cat_contiguous_cpu(
    mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v
):
    """The contiguous layout of ``kernels/ops/attention/triton_gdn_fused_proj.py:272``: ``[q | k | v | z]`` and
    ``[b | a]`` become ``[q | k | v]``, z ``[n, heads_v, head_v]``, b and a ``[n, heads_v]``."""
    qkv_dim = num_heads_qk * head_qk * 2 + num_heads_v * head_v
    batch = mixed_qkvz.shape[0]
    mixed_qkv = mixed_qkvz[:, :qkv_dim].contiguous()
    z = mixed_qkvz[:, qkv_dim:].reshape(batch, num_heads_v, head_v).contiguous()
    return mixed_qkv, z, mixed_ba[:, :num_heads_v].contiguous(), mixed_ba[:, num_heads_v:].contiguous()


_OPS = {
    "fused_sigmoid_mul_cpu(Tensor(a!) x, Tensor gate) -> ()": fused_sigmoid_mul_cpu,
    "fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim)"
    " -> (Tensor, Tensor)": fused_qk_gemma_rmsnorm_cpu,
    "fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, "
    "int head_dim, int num_head) -> (Tensor, Tensor, Tensor)": fused_qk_gemma_rmsnorm_with_gate_cpu,
    "fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, "
    "int num_heads_v, int head_qk, int head_v) -> (Tensor, Tensor, Tensor, Tensor)": (
        fused_qkvzba_split_reshape_cat_contiguous_cpu
    ),
}

for _schema, _fn in _OPS.items():
    _name = _schema.split("(", 1)[0]
    if not hasattr(torch.ops.sgl_kernel, _name):
        _LIB.define(_schema)
        _LIB.impl(_name, _fn, "CPU")
