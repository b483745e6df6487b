"""Loss aggregation: how per-token losses ``[batch, seq]`` become one scalar (ALGORITHMS.md, "aggregation").

Every mode is a weighted sum ``Σ_{i,t} weight_{i,t} · l_{i,t}``; :func:`token_weights` builds the weights and
:func:`aggregate` applies them, so the two can never disagree.

Global normalisers: under data parallelism and gradient accumulation a rank sees only a micro-batch. Passing
the *global* ``num_sequences`` (sequences with at least one valid token) or ``num_tokens`` (valid tokens) makes
the per-micro-batch results sum, over micro-batches and ranks, to the full-batch value, whatever the layout.
A sequence must not be split across micro-batches (``|y_i|`` is taken from the local mask).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

AggMode = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)

Normaliser = int | float | torch.Tensor


def token_weights(
    mask_bt: torch.Tensor,
    mode: AggMode,
    *,
    num_sequences: Normaliser | None = None,
    num_tokens: Normaliser | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Per-token weights ``[batch, seq]`` (fp32, zero on masked tokens) so that ``aggregate = Σ l·weight``.

    - ``seq-mean-token-mean``: ``1 / (G · |y_i|)`` (GRPO, SAPO, GSPO as published)
    - ``token-mean``: ``1 / Σ_i |y_i|`` (DAPO)
    - ``seq-mean-token-sum-norm``: ``1 / (G · max_len)`` (Dr.GRPO); ``max_len`` is required.

    ``G`` is ``num_sequences`` when given, else the local number of sequences with a valid token;
    ``Σ|y|`` is ``num_tokens`` when given, else the local valid-token count.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {list(AGG_MODES)}")
    mask = mask_bt.float()
    len_b = mask.sum(-1)
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return mask / _at_least_one(denom)
    # Empty sequences (e.g. fully masked padding rows) must not dilute the mean.
    num_seq = (len_b > 0).sum() if num_sequences is None else num_sequences
    if mode == "seq-mean-token-mean":
        return mask / len_b.clamp(min=1.0)[:, None] / _at_least_one(num_seq)
    if max_len is None:
        raise ValueError("agg='seq-mean-token-sum-norm' needs max_len (the L_max of the Dr.GRPO normaliser)")
    return mask / (_at_least_one(num_seq) * max_len)


def aggregate(
    loss_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    mode: AggMode,
    *,
    num_sequences: Normaliser | None = None,
    num_tokens: Normaliser | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Scalar aggregate of ``loss_bt`` ``[batch, seq]`` over the valid tokens of ``mask_bt``; see :func:`token_weights`."""
    weight_bt = token_weights(
        mask_bt, mode, num_sequences=num_sequences, num_tokens=num_tokens, max_len=max_len
    )
    # where, not a product, so non-finite values on padded tokens cannot leak in as 0 · inf = nan.
    return torch.where(mask_bt.bool(), loss_bt * weight_bt, 0.0).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is true (same shape); 0 when nothing is selected."""
    mask = mask.bool()
    return torch.where(mask, x.float(), 0.0).sum() / mask.sum().clamp(min=1)


def _at_least_one(n: Normaliser) -> torch.Tensor | float:
    # An empty micro-batch then yields an exact 0 instead of 0/0.
    return n.clamp(min=1) if isinstance(n, torch.Tensor) else max(n, 1)
