"""The CPU rollout engine's numerics: ``fp32``, ``bf16``, or ``fp8`` as SGLang serves block-wise fp8 weights.

A rollout engine that computes in lower precision than the trainer is the usual source of training-inference
mismatch (and of MoE routing changes); these precisions let the CPU engine create that mismatch on purpose.

- ``fp32``: the model as loaded; the engine's log-probs equal the trainer's to about 1e-7.
- ``bf16``: weights and activations in bf16 (``--dtype bfloat16``). Buffers stay as they are: the rotary
  frequencies stay fp32 and cos/sin are cast to bf16 when used, as in transformers and SGLang. The logits come out
  of the bf16 lm_head and are upcast to fp32 before ``log_softmax``, as SGLang's ``LogitsProcessor._get_logits``
  does (``logits[:, :vocab_size].float()``; ``--enable-fp32-lm-head`` is off by default).
- ``fp8``: ``bf16`` plus SGLang's block-wise W8A8 fp8 (``Fp8LinearMethod`` / ``Fp8MoEMethod`` with
  ``weight_block_size = [128, 128]``) on the linear layers of the decoder: attention q/k/v/o, dense MLP and
  expert gate/up/down. Each weight matrix ``[N, K]`` is cut into 128x128 blocks (edge blocks partial); block
  ``(i, j)`` has ``scale = max(amax(block), 1e-4) / 448`` and ``q = e4m3(clamp(w / scale, -448, 448))``; the
  engine keeps the dequantised ``q * scale`` in fp32. Every input of such a layer is quantised dynamically per
  token and group of 128 features (``scale = max(amax(group), 1e-10) / 448``), the product is computed in fp32
  and written in bf16, as SGLang's fp8 GEMM kernels accumulate in fp32 and write the activation dtype.
  Embeddings, norms, the MoE router and the lm_head stay bf16.

Sources read (sgl-project/sglang, ``python/sglang/srt/``):

- ``layers/quantization/fp8.py``: ``Fp8Config.get_quant_method`` quantises ``LinearBase`` and ``FusedMoE`` layers
  only (``ParallelLMHead`` is an embedding and gets no method); block scales need ``activation_scheme: dynamic``
  and come with an fp8-serialised checkpoint (``weight_block_size``); ``Fp8LinearMethod.apply`` runs
  ``w8a8_block_fp8_linear`` on the block path; ``Fp8MoEMethod.process_weights_after_loading_block_quant``.
- ``layers/quantization/fp8_utils.py``: ``triton_w8a8_block_fp8_linear`` (activations through
  ``per_token_group_quant_fp8(x, block_size[1])``, output in the input's dtype), ``per_block_cast_to_fp8`` (zero
  padding to multiples of 128, so an edge block's amax is over its real entries; ``amax.clamp(1e-4) / 448``),
  ``block_quant_dequant`` (scales repeated over each block and cropped at the edges).
- ``layers/quantization/fp8_kernel.py`` (``kernels/ops/quantization/`` in newer trees):
  ``_per_token_group_quant_fp8`` (``absmax`` clamped at ``eps = 1e-10``, ``scale = absmax / fp8_max``,
  ``clamp(y / scale, fp8_min, fp8_max)`` cast to e4m3).
- ``layers/moe/fused_moe_triton``: with block fp8 the experts' input and the act-and-mul output (the input of
  ``w2``) are each quantised per token group of ``block_k``.
- ``models/qwen3_moe.py``: the router ``gate`` is a ``ReplicatedLinear`` without quant config ("the online Fp8 path
  keeps the gate in bf16"); ``lm_head`` is a ``ParallelLMHead``.
- ``layers/logits_processor.py``: ``_get_logits`` (bf16 matmul, then ``.float()``) and ``log_softmax`` in fp32.

Where this differs from SGLang, on purpose or by necessity:

- SGLang's ``--quantization fp8`` on a bf16/fp32 checkpoint quantises **online** per output channel (CUTLASS
  GPUs; per tensor elsewhere) with per-token activations (``Fp8LinearMethod.process_weights_after_loading``), and
  experts per tensor (``Fp8MoEMethod``); 128x128 blocks are what it serves for an fp8-serialised checkpoint
  (``quantization_config.weight_block_size: [128, 128]``, e.g. Qwen3-*-FP8, and FP8 rollouts that ship block-fp8
  weights). This engine implements the block scheme.
- SGLang refuses block shapes that do not divide 128 on merged or tensor-parallel weights, and activation widths
  that are not multiples of the group; tiny models here have such shapes, so each checkpoint tensor (``q_proj``,
  each expert's ``gate_proj``, ...) is blocked on its own with partial edge blocks, and a partial last activation
  group takes its amax over its real entries.
- The fp32 product of dequantised operands equals the fp8 kernel's result up to fp32 rounding order.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.nn.functional as F

from sapo_megatron.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Precision = Literal["fp32", "bf16", "fp8"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp8")
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
WEIGHT_BLOCK = (128, 128)
ACTIVATION_GROUP = 128
WEIGHT_AMAX_FLOOR = 1e-4  # per_block_cast_to_fp8
ACTIVATION_AMAX_FLOOR = 1e-10  # per_token_group_quant_fp8's eps
# Router gates (Qwen2/3-MoE ``mlp.gate``, ``shared_expert_gate``) stay unquantised, as in SGLang's models.
_UNQUANTIZED_LINEARS = ("gate", "shared_expert_gate")


class PrecisionError(UserError, ValueError):
    """An unknown precision, or a model layout the fp8 path cannot handle."""


def check_precision(precision: str) -> str:
    """``precision`` if it is one of ``PRECISIONS``, else a PrecisionError naming the choices."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"rollout precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    return precision


# ---------------------------------------------------------------------------------------------------- fp8 math
def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 quantisation of ``weight [..., N, K]`` (leading dims are independent matrices).

    Returns ``q`` (float8_e4m3fn, ``[..., N, K]``) and ``scale`` (fp32, ``[..., ceil(N/bn), ceil(K/bk)]``) with
    ``weight ≈ q * scale`` block by block; ``scale = max(amax(block), 1e-4) / 448``.
    """
    *lead, rows, cols = weight.shape
    block_rows, block_cols = block
    n_row_blocks, n_col_blocks = math.ceil(rows / block_rows), math.ceil(cols / block_cols)
    padded = weight.new_zeros(
        (*lead, n_row_blocks * block_rows, n_col_blocks * block_cols), dtype=torch.float32
    )
    padded[..., :rows, :cols] = weight
    tiles = padded.view(*lead, n_row_blocks, block_rows, n_col_blocks, block_cols)
    scale = tiles.abs().amax(dim=(-3, -1)).clamp(min=WEIGHT_AMAX_FLOOR) / E4M3_MAX
    scaled = tiles * (1.0 / scale)[..., :, None, :, None]  # per_block_cast_to_fp8 multiplies by the inverse
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view_as(padded)[..., :rows, :cols].contiguous(), scale


def dequantize_blocks(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK
) -> torch.Tensor:
    """fp32 ``q * scale``, each scale repeated over its block and cropped at the edges. Shapes as above."""
    *_, rows, cols = q.shape
    repeated = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return q.float() * repeated[..., :rows, :cols]


def fake_quantize_weight(weight: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK) -> torch.Tensor:
    """The fp32 weight an fp8 engine computes with: ``dequantize_blocks(*quantize_blocks(weight))``."""
    return dequantize_blocks(*quantize_blocks(weight, block), block)


def fake_quantize_activation(x: torch.Tensor, group: int = ACTIVATION_GROUP) -> torch.Tensor:
    """Dynamic per-token-group e4m3 quantise-dequantise of ``x [..., K]`` (groups of ``group`` features along K).

    Each group: ``scale = max(amax, 1e-10) / 448``, ``q = e4m3(clamp(x / scale, -448, 448))``; returns fp32
    ``q * scale`` of ``x``'s shape. A partial last group (K not a multiple of ``group``) scales by its own entries.
    """
    *lead, width = x.shape
    n_groups = math.ceil(width / group)
    padded = x.new_zeros((*lead, n_groups * group), dtype=torch.float32)
    padded[..., :width] = x
    groups = padded.view(*lead, n_groups, group)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=ACTIVATION_AMAX_FLOOR) / E4M3_MAX
    q = (groups / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).view(*lead, n_groups * group)[..., :width]


# ---------------------------------------------------------------------------------------------- model numerics
class EngineNumerics:
    """Applies one precision to an engine's model, and to every weight loaded into it afterwards.

    ``quantized`` holds the model parameter names with fp8 weights (empty unless ``fp8``): they are kept in fp32
    as dequantised values; every other parameter has the engine's compute dtype.
    """

    def __init__(self, precision: str) -> None:
        self.precision = check_precision(precision)
        self.compute_dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        self.quantized: frozenset[str] = frozenset()

    def install(self, model: PreTrainedModel) -> None:
        """Cast ``model``'s parameters (in place), and for fp8 quantise its linear layers and hook their forwards."""
        if self.precision == "fp32":
            return
        if self.precision == "fp8":  # quantised from the values as loaded, never from a bf16 rounding of them
            self.quantized = frozenset(_install_fp8(model))
        for name, param in model.named_parameters(remove_duplicate=False):
            if name not in self.quantized:  # parameters only: the rotary inv_freq buffer stays fp32
                param.data = param.data.to(self.compute_dtype)
        self.requantize_(model)

    def load_(self, param_name: str, target: torch.Tensor, value: torch.Tensor) -> None:
        """Copy ``value`` into ``target`` (a view of parameter ``param_name``) in this precision; fp8 re-quantises."""
        target.copy_(value.to(device=target.device, dtype=target.dtype))
        if param_name in self.quantized:
            _fake_quantize_(param_name, target)

    def requantize_(self, model: torch.nn.Module) -> None:
        """Quantise every fp8 parameter from the values it holds now (after a full load, or at install)."""
        params = dict(model.named_parameters(remove_duplicate=False))
        for name in sorted(self.quantized):
            _fake_quantize_(name, params[name].data)

    def describe(self) -> dict[str, str | None]:
        """SGLang's server-args fields for this precision: ``dtype`` and ``quantization``."""
        dtype = "float32" if self.precision == "fp32" else "bfloat16"
        return {"dtype": dtype, "quantization": "fp8" if self.precision == "fp8" else None}


def _fake_quantize_(param_name: str, weight: torch.Tensor) -> None:
    """Replace ``weight`` (a parameter or a view of one) by its fp8 block quantise-dequantise, in place.

    A fused ``experts.gate_up_proj [E, 2F, H]`` holds two checkpoint tensors per expert (gate, then up): each is
    blocked on its own, like ``experts.{e}.gate_proj.weight`` and ``experts.{e}.up_proj.weight`` on disk.
    """
    units = weight
    if param_name.endswith("experts.gate_up_proj") and weight.dim() == 3:
        experts, rows, cols = weight.shape
        units = weight.view(experts, 2, rows // 2, cols)
    units.copy_(fake_quantize_weight(units))


def _install_fp8(model: PreTrainedModel) -> Iterator[str]:
    """Hook the decoder's quantised layers (fp32 dequantised weights, fp8 activations); yields their weight names."""
    decoder_layers = model.get_decoder().layers
    prefix = _module_name(model, decoder_layers)
    for name, module in decoder_layers.named_modules():
        full_name = f"{prefix}.{name}"
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in _UNQUANTIZED_LINEARS:
            module.weight.data = module.weight.data.float()
            module.forward = types.MethodType(_fp8_linear_forward, module)  # type: ignore[method-assign]  # this instance's forward, on purpose
            yield f"{full_name}.weight"
        elif _is_fused_experts(module):
            _check_fused_experts(full_name, module)
            module.gate_up_proj.data = module.gate_up_proj.data.float()
            module.down_proj.data = module.down_proj.data.float()
            module.forward = types.MethodType(_fp8_experts_forward, module)
            yield f"{full_name}.gate_up_proj"
            yield f"{full_name}.down_proj"


def _module_name(model: torch.nn.Module, target: torch.nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise PrecisionError("fp8 rollout: the decoder layers are not a submodule of the model")


def _is_fused_experts(module: torch.nn.Module) -> bool:
    """transformers >= 5 keeps a MoE layer's experts in 3-D parameters ``gate_up_proj`` and ``down_proj``."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.nn.Parameter)
        and isinstance(down, torch.nn.Parameter)
        and gate_up.dim() == 3
    )


def _check_fused_experts(name: str, module: torch.nn.Module) -> None:
    layout = {attr: getattr(module, attr, default) for attr, default in _FUSED_LAYOUT.items()}
    if layout != _FUSED_LAYOUT:
        raise PrecisionError(
            f"fp8 rollout supports fused experts laid out as {_FUSED_LAYOUT}; {name} has {layout}",
            hint="use rollout.precision bf16 or fp32 for this model",
        )


# The layout _fp8_experts_forward computes: gate rows then up rows in gate_up_proj [E, 2F, H], no biases.
_FUSED_LAYOUT = {"is_transposed": False, "is_concatenated": True, "has_bias": False, "has_gate": True}


def _fp8_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """W8A8 linear: fp8 activations x fp8 weights accumulated in fp32, written in the activation dtype."""
    out = F.linear(fake_quantize_activation(x), self.weight).to(x.dtype)
    return out if self.bias is None else out + self.bias


class _FusedExperts(Protocol):
    """transformers' fused experts of one MoE layer (:func:`_is_fused_experts`)."""

    num_experts: int
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor

    def act_fn(self, x: torch.Tensor) -> torch.Tensor: ...


def _fp8_experts_forward(
    self: _FusedExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The fused experts of one MoE layer in W8A8 fp8, as SGLang's fused MoE kernel with block fp8 computes them.

    hidden_states ``[T, H]`` (bf16), top_k_index / top_k_weights ``[T, k]``; returns ``[T, H]`` in the input's
    dtype. Both GEMM inputs are quantised per token group; each GEMM writes bf16 (the routing weight is applied in
    the second GEMM's fp32 accumulator), and the k expert outputs of a token are summed.
    """
    act_dtype = hidden_states.dtype
    x = fake_quantize_activation(hidden_states)
    out = torch.zeros(hidden_states.shape, dtype=torch.float32)
    for expert in top_k_index.unique().tolist():
        if not 0 <= expert < self.num_experts:  # transformers marks experts of other EP ranks this way
            continue
        token_idx, k_pos = torch.where(top_k_index == expert)
        gate, up = F.linear(x[token_idx], self.gate_up_proj[expert]).to(act_dtype).chunk(2, dim=-1)
        hidden = self.act_fn(gate) * up
        expert_out = F.linear(fake_quantize_activation(hidden), self.down_proj[expert])
        expert_out = expert_out * top_k_weights[token_idx, k_pos, None].float()
        out.index_add_(0, token_idx, expert_out.to(act_dtype).float())
    return out.to(act_dtype)
