"""Packed micro-batches (:mod:`sapo_megatron.model.packing`) on Megatron-Core: what ``GPTModel.forward`` gets.

A packed micro-batch is one row ``[1, T]`` of several sequences; attention must stay inside each sequence and
RoPE must restart at each. Both are derived from ``position_ids`` alone – a segment starts wherever they restart
at 0 (each sequence's slot, and the tail padding as a segment of its own) – so the two paths below are the same
attention by construction:

- **Transformer Engine spec (GPU)**: the THD layout. ``packed_seq_params = PackedSeqParams(qkv_format="thd",
  cu_seqlens_q = cu_seqlens_kv = [0, end of segment 1, ..., T], the same as the ``*_padded`` ones, max_seqlen_q =
  max_seqlen_kv = the longest segment)``. Megatron then (checked in megatron-core 0.16.1 and 0.19.0):
  ``get_rotary_seq_len`` returns ``max_seqlen`` and ``apply_rotary_pos_emb`` → ``_apply_rotary_pos_emb_thd``
  applies ``freqs[0 : len]`` to every segment (RoPE restarts); ``TEDotProductAttention`` turns the ``causal``
  mask into ``padding_causal`` for ``thd`` and hands the ``cu_seqlens`` to TE's fused attention (a sequence's
  slot padding sits after its tokens, so causal attention never lets a real token see it – the same choice as
  NeMo-RL, which passes the padded ``cu_seqlens`` as both). ``attention_mask`` is ``None``. Under sequence
  parallelism the ``[T, 1, h]`` activations are split along ``T`` across the TP ranks: every slot is a multiple
  of the TP size (``length_multiple``), so ``T`` is too.
- **Local spec (CPU here, or GPUs without TE)**: Megatron's ``DotProductAttention`` refuses ``packed_seq_params``
  but takes any ``attention_mask``: ``FusedScaleMaskSoftmax`` (``masked_softmax_fusion`` is off) uses a given
  mask instead of building the causal one, through ``attention_mask_func`` = ``masked_fill_(mask, -10000)`` on the
  fp32 scores (True = masked; exp(-10000 - max) is exactly 0 in fp32). So the mask here is block-diagonal causal,
  ``[b, 1, s, s]``. RoPE: ``GPTModel`` computes the rotary table for positions ``0..s-1`` of the row and ignores
  ``position_ids`` for ``rope``; a forward hook on its ``rotary_pos_emb`` (installed for the one forward call)
  re-indexes that table by ``position_ids`` into ``[s, b, 1, d]``, which ``_apply_rotary_pos_emb_bshd``
  broadcasts over the heads – row ``p`` of ``outer(arange, inv_freq)`` is the same whatever the table's length,
  so a packed token gets bitwise the angle it has in its padded row.

Padded micro-batches (no ``segment_ids``) go through unchanged: ``position_ids`` arange, no mask (causal).

Vision-language models (:class:`~sapo_megatron.megatron.vl_model.VLGPTModel`) also get the micro-batch's
``pixel_values`` and ``image_grid_thw``; their MRoPE table is computed from ``position_ids`` (per segment) by
the model itself, so the local path installs no RoPE hook. The THD path is refused for them: Megatron's THD
RoPE applies ``freqs[0 : len]`` to every segment, which cannot carry per-token 3-D positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from sapo_megatron.megatron.context_parallel import TokenShards, batch_shards, causal_mask, shard_tokens
from sapo_megatron.model.batching import IMAGE_MASK
from sapo_megatron.model.packing import POSITION_IDS, is_packed

MicroBatch = Mapping[str, torch.Tensor]


def segment_bounds(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 ``[segments + 1]``: where each segment of a packed ``[1, T]`` row starts, then ``T`` (THD's
    ``cu_seqlens``)."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(
            f"a packed micro-batch is one row [1, T]; got position_ids {list(position_ids.shape)}"
        )
    row = position_ids[0]
    starts = (row == 0).nonzero().squeeze(1)
    total = torch.tensor([row.numel()], dtype=starts.dtype, device=starts.device)
    return torch.cat([starts, total]).to(torch.int32)


def thd_params(position_ids: torch.Tensor, device: torch.device | None = None) -> PackedSeqParams:
    """``PackedSeqParams`` of a packed ``[1, T]`` row for Transformer Engine's THD attention (see the module
    docstring); ``cu_seqlens`` on ``device`` (the model's), ``max_seqlen`` a Python int."""
    bounds = segment_bounds(position_ids.cpu())
    longest = int((bounds[1:] - bounds[:-1]).max())
    cu_seqlens = bounds.to(device or position_ids.device)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens,
        cu_seqlens_kv_padded=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """bool ``[b, 1, s, s]``, True where query ``q`` must not see key ``k``: another segment, or ``k > q``."""
    segment = (position_ids == 0).cumsum(dim=-1)  # [b, s]: segment number, restarting positions start one
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(position_ids.shape[-1], position_ids.shape[-1], dtype=torch.bool).tril()
    return ~(same & causal.to(position_ids.device))[:, None]


def uses_local_attention(model: torch.nn.Module) -> bool:
    """Does this model chunk attend with Megatron's local ``DotProductAttention`` (no THD)?"""
    return any(
        isinstance(layer.self_attention.core_attention, DotProductAttention)
        for layer in _gpt(model).decoder.layers
    )


@contextlib.contextmanager
def model_inputs(model: torch.nn.Module, batch: MicroBatch) -> Iterator[dict[str, Any]]:
    """Keyword arguments of ``model(batch["input_ids"], **kwargs)`` for this micro-batch, valid inside the block
    (the local path's RoPE hook is removed when it exits). Under context parallelism the keyword arguments also
    hold ``input_ids``: this CP rank's tokens (:func:`context_parallel_inputs`)."""
    shards = batch_shards(batch)
    if shards is not None:
        with context_parallel_inputs(model, batch, shards) as inputs:
            yield inputs
        return
    input_ids = batch["input_ids"]
    vision = _vision_inputs(model, batch)
    if not is_packed(batch):
        position_ids = batch.get(POSITION_IDS)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        yield {"position_ids": position_ids, "attention_mask": None, **vision}
        return
    position_ids = batch[POSITION_IDS].to(input_ids.device)
    if _is_vl(model):
        if not uses_local_attention(model):
            raise NotImplementedError(
                "packed micro-batches of a vision-language model need Megatron's local attention (block mask); "
                "THD RoPE cannot carry MRoPE positions: set parallel.max_tokens_per_micro_batch: null"
            )
        yield {"position_ids": position_ids, "attention_mask": block_causal_mask(position_ids), **vision}
        return
    if not uses_local_attention(model):
        yield {
            "position_ids": position_ids,
            "attention_mask": None,
            "packed_seq_params": thd_params(position_ids, input_ids.device),
        }
        return
    rotary = _gpt(model).rotary_pos_emb
    handle = rotary.register_forward_hook(rope_at_positions(position_ids))
    try:
        yield {"position_ids": position_ids, "attention_mask": block_causal_mask(position_ids)}
    finally:
        handle.remove()


@contextlib.contextmanager
def context_parallel_inputs(
    model: torch.nn.Module, batch: MicroBatch, shards: TokenShards
) -> Iterator[dict[str, Any]]:
    """``model(**kwargs)`` for this CP rank's tokens (:mod:`~sapo_megatron.megatron.context_parallel`).

    - Transformer Engine (GPU): padded rows as Megatron's ``get_batch_on_this_cp_rank`` slices them, no mask
      (TE's CP attention is causal over the chunks; ``RotaryEmbedding`` slices its table with
      ``get_pos_emb_on_this_cp_rank``, the same chunks); packed rows as TE's ``thd_get_partitioned_indices``
      partitions them, with :func:`thd_params` over the *whole* slots (``_apply_rotary_pos_emb_thd`` divides
      each ``cu_seqlens`` length by cp and takes this rank's two chunks of each). Checked against megatron-core
      0.16.1's ``utils.py``, ``rope_utils.py`` and ``models/multimodal/llava_model.py`` (the THD partitioning).
    - Local attention (CPU): :func:`~.context_parallel.causal_mask` for the
      :class:`~.context_parallel.ContextParallelAttention`, and a RoPE hook that takes the rotary table at the
      tokens' own positions (Megatron's CP slicing of the table assumes one padded row).
    """
    input_ids = batch["input_ids"]
    local_attention = uses_local_attention(model)
    if _is_vl(model):  # the model slices its MRoPE positions and image rows itself (VLGPTModel's cp_local)
        if is_packed(batch) and not local_attention:
            raise NotImplementedError(
                "packed micro-batches of a vision-language model need Megatron's local attention (block mask); "
                "THD RoPE cannot carry MRoPE positions: set parallel.max_tokens_per_micro_batch: null"
            )
        yield {
            "input_ids": input_ids,
            "position_ids": batch.get(POSITION_IDS),
            "attention_mask": causal_mask(batch, shards) if local_attention else None,
            "cp_local": shards.local.to(input_ids.device),
            **_vision_inputs(model, batch),
        }
        return
    position_ids = batch.get(POSITION_IDS)
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    local = {
        "input_ids": shard_tokens(input_ids, shards),
        "position_ids": shard_tokens(position_ids.to(input_ids.device), shards),
    }
    if not local_attention:
        if is_packed(batch):
            local["packed_seq_params"] = thd_params(position_ids, input_ids.device)
        yield {**local, "attention_mask": None}
        return
    rotary = _gpt(model).rotary_pos_emb
    handle = rotary.register_forward_hook(rope_at_global_positions(local["position_ids"]))
    try:
        yield {**local, "attention_mask": causal_mask(batch, shards)}
    finally:
        handle.remove()


def rope_at_global_positions(position_ids: torch.Tensor):
    """Forward hook for ``GPTModel.rotary_pos_emb`` under CP: the rotary table of ``position_ids`` ``[b, s/cp]``
    (this rank's tokens' positions in their sequences) ``[s/cp, b, 1, d]``, computed whole with ``get_emb`` – the
    module's own output is sliced for one padded row of ``2·cp`` chunks."""

    def hook(module: Any, args: Any, table: torch.Tensor) -> torch.Tensor:
        whole = module.get_emb(int(position_ids.max()) + 1)
        return whole[:, 0][position_ids.t().to(whole.device)]

    return hook


VISION_INPUTS = ("pixel_values", "image_grid_thw")
"""Micro-batch keys a vision-language model takes as they are (the images of the micro-batch's rows)."""


def _vision_inputs(model: torch.nn.Module, batch: MicroBatch) -> dict[str, torch.Tensor]:
    device = batch["input_ids"].device
    vision = {k: batch[k].to(device) for k in VISION_INPUTS if k in batch}
    if IMAGE_MASK in batch:  # image pads outside the prompts' images (sampled by the policy) are text
        vision[IMAGE_MASK] = batch[IMAGE_MASK].to(device).bool()
    elif _is_vl(model) and "pixel_values" not in batch:  # no images here: every image pad is text
        vision[IMAGE_MASK] = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    return vision


def _is_vl(model: torch.nn.Module) -> bool:
    while not isinstance(model, GPTModel) and isinstance(
        inner := getattr(model, "module", None), torch.nn.Module
    ):
        model = inner
    arch = getattr(model, "arch", None)
    return arch is not None and arch.is_vl


def rope_at_positions(position_ids: torch.Tensor):
    """Forward hook for ``GPTModel.rotary_pos_emb``: its ``[s, 1, 1, d]`` table re-indexed by ``position_ids``
    ``[b, s]`` into ``[s, b, 1, d]`` (a new tensor: the module caches its outputs)."""

    def hook(module: torch.nn.Module, args: Any, table: torch.Tensor) -> torch.Tensor:
        return table[:, 0][position_ids.t().to(table.device)]

    return hook


def _gpt(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module)."""
    while not isinstance(model, GPTModel):
        inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            raise TypeError(f"no GPTModel inside {type(model).__name__}")
        model = inner
    return model
