"""Sequence packing: sequences of different lengths share a micro-batch up to a token budget
(``parallel.max_tokens_per_micro_batch``) instead of each taking a row of one right-padded rectangle. Pure
Python and torch; :mod:`sapo_megatron.model.batching` lays the tensors out, :mod:`sapo_megatron.megatron.packed_seq`
feeds them to Megatron (THD through ``PackedSeqParams`` with Transformer Engine, else a block-diagonal causal
mask with per-sequence RoPE).

Plan (:func:`plan_packing`), computed identically on every rank from the whole update's sequences, so the ranks
agree without communicating:

1. each sequence takes a *slot* of ``P + R - 1`` model positions rounded up to the length multiple (the TP size
   under sequence parallelism, as Megatron's THD + SP needs; FP8 multiples likewise);
2. first-fit-decreasing sizes the packing: the fewest micro-batches it finds, rounded up to a multiple of the
   data-parallel size (every rank must run the same number of micro-batches: pipeline stages exchange them one
   by one, expert-parallel all-to-alls pair them across ranks) and at least ``micro_batches`` per rank;
3. the sequences, longest first, go onto that many micro-batches twice – first-fit, and onto the least-loaded
   one – and the placement with the lighter heaviest micro-batch wins (first-fit always fits; least-loaded
   usually balances better, and the step costs ``count × heaviest`` once every micro-batch is padded to it);
4. micro-batches, heaviest first, go to the rank with the fewest tokens that still needs one (equal counts,
   balanced tokens per rank);
5. every micro-batch of the update is padded to one length, the heaviest load (one activation shape per pipeline
   schedule).

A packed micro-batch is one row ``[1, T]``: the sequences' slots back to back (in the order they were given),
then tail padding. ``position_ids`` restart at 0 at every slot and at the tail (RoPE restarts per sequence; the
THD ``cu_seqlens`` are where they restart), ``segment_ids`` give each token's sequence within the micro-batch
(-1 on the tail). :class:`SequenceView` turns any per-token tensor back into per-sequence rows ``[n, w]`` – the
layout the policy losses, their aggregation modes and the sequence normalisers are written for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from sapo_megatron.errors import UserError

SEGMENT_IDS = "segment_ids"
"""Packed micro-batches: int64 ``[1, T]``, the index of each token's sequence within the micro-batch, -1 on the
tail padding. Its presence marks a micro-batch as packed."""

POSITION_IDS = "position_ids"
"""int64 ``[b, s]``: each token's position within its sequence (packed: restarting at every slot and the tail)."""


class PackingError(UserError):
    """Sequences that cannot be packed under ``parallel.max_tokens_per_micro_batch``."""


@dataclass(frozen=True)
class PackingPlan:
    """Which sequences each rank's micro-batches hold (indices into the planned list, ascending), and the one
    length ``T`` every micro-batch is padded to."""

    micro_batches: list[list[list[int]]]
    """Per data-parallel rank, per micro-batch: sequence indices."""
    length: int

    def loads(self, slots: Sequence[int]) -> list[list[int]]:
        """Tokens (slots, padding of each slot included) per rank and micro-batch."""
        return [[sum(slots[i] for i in mb) for mb in rank] for rank in self.micro_batches]


def slot_length(model_positions: int, multiple: int = 1) -> int:
    """Tokens a sequence of ``model_positions`` (``P + R - 1``) takes in a packed row: at least one, rounded up to
    ``multiple``."""
    return -(-max(model_positions, 1) // multiple) * multiple


def plan_packing(
    slots: Sequence[int],
    budget: int,
    *,
    ranks: int,
    min_micro_batches: int = 1,
    names: Sequence[str] | None = None,
) -> PackingPlan:
    """Pack sequences of ``slots`` tokens each into micro-batches of at most ``budget`` tokens, the same number on
    each of ``ranks`` data-parallel ranks (at least ``min_micro_batches``); see the module docstring.

    Raises :class:`PackingError` naming the first sequence (``names[i]``, else its index) longer than the budget."""
    if not slots:
        raise ValueError("plan_packing needs at least one sequence")
    _check_fits(slots, budget, names)
    order = sorted(range(len(slots)), key=lambda i: (-slots[i], i))
    count = _round_up(max(len(_first_fit(order, slots, budget)), ranks * min_micro_batches), ranks)
    candidates = [_first_fit(order, slots, budget, count), _least_loaded(order, slots, budget, count)]
    bins = min((c for c in candidates if c is not None), key=lambda c: _heaviest(c, slots))
    per_rank = _deal_to_ranks(bins, slots, ranks)
    return PackingPlan([[sorted(mb) for mb in rank] for rank in per_rank], _heaviest(bins, slots))


def _check_fits(slots: Sequence[int], budget: int, names: Sequence[str] | None) -> None:
    for index, slot in enumerate(slots):
        if slot > budget:
            name = names[index] if names else f"sequence {index}"
            raise PackingError(
                f"{name} takes {slot} tokens (prompt + response - 1, rounded up to the length multiple), more "
                f"than parallel.max_tokens_per_micro_batch={budget}",
                hint="raise parallel.max_tokens_per_micro_batch to at least the longest prompt + "
                "rollout.max_new_tokens, or set it to null (padded micro-batches)",
            )


def _first_fit(
    order: Sequence[int], slots: Sequence[int], budget: int, count: int | None = None
) -> list[list[int]]:
    """First fit in ``order`` (longest first: first-fit-decreasing); opens micro-batches as needed, or starts
    with ``count`` of them (never more needed when ``count`` ≥ the unconstrained result)."""
    bins: list[list[int]] = [[] for _ in range(count or 0)]
    loads = [0] * len(bins)
    for i in order:
        fit = next((b for b, load in enumerate(loads) if load + slots[i] <= budget), None)
        if fit is None:
            bins.append([])
            loads.append(0)
            fit = len(bins) - 1
        bins[fit].append(i)
        loads[fit] += slots[i]
    return bins


def _least_loaded(
    order: Sequence[int], slots: Sequence[int], budget: int, count: int
) -> list[list[int]] | None:
    """In ``order`` onto the least-loaded of ``count`` micro-batches; None if one does not fit there."""
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in order:
        target = min(range(count), key=lambda b: (loads[b], b))
        if loads[target] + slots[i] > budget:
            return None  # the least-loaded one is full: no other has room either
        bins[target].append(i)
        loads[target] += slots[i]
    return bins


def _heaviest(bins: list[list[int]], slots: Sequence[int]) -> int:
    return max(sum(slots[i] for i in mb) for mb in bins)


def _deal_to_ranks(bins: list[list[int]], slots: Sequence[int], ranks: int) -> list[list[list[int]]]:
    """Heaviest micro-batch first to the rank with the fewest tokens among those still short of their share."""
    share = len(bins) // ranks
    per_rank: list[list[list[int]]] = [[] for _ in range(ranks)]
    tokens = [0] * ranks
    for mb in sorted(bins, key=lambda mb: -sum(slots[i] for i in mb)):
        rank = min((r for r in range(ranks) if len(per_rank[r]) < share), key=lambda r: (tokens[r], r))
        per_rank[rank].append(mb)
        tokens[rank] += sum(slots[i] for i in mb)
    return per_rank


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def is_packed(batch: Mapping[str, torch.Tensor]) -> bool:
    return SEGMENT_IDS in batch


class SequenceView:
    """Per-sequence rows of a micro-batch's per-token tensors.

    Padded micro-batches: the identity (a row is a sequence). Packed ones: token ``t`` of sequence ``i`` (its
    ``position_ids`` value ``p``) goes to row ``i``, column ``p`` of a zero-filled ``[n, w]`` tensor (``w`` the
    longest slot); the tail padding is dropped. A packed micro-batch without sequences (a rank can get one when
    there are fewer sequences than micro-batches) is one empty row, as a padded row without tokens would be.
    Differentiable, so a loss computed on the view back-propagates into the packed log-probs.
    """

    def __init__(self, batch: Mapping[str, torch.Tensor]) -> None:
        self.packed = is_packed(batch)
        if not self.packed:
            return
        segment = batch[SEGMENT_IDS].reshape(-1)
        position = batch[POSITION_IDS].reshape(-1)
        self._tokens = (segment >= 0).nonzero().squeeze(1)
        self._rows, self._cols = segment[self._tokens], position[self._tokens]
        empty = self._tokens.numel() == 0
        self.sequences = 0 if empty else int(self._rows.max()) + 1
        self.shape = (1, 1) if empty else (self.sequences, int(self._cols.max()) + 1)
        self._index: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def __call__(self, x_bt: torch.Tensor) -> torch.Tensor:
        """``[b, s, ...]`` → ``[n, w, ...]`` (packed), or ``x_bt`` itself (padded)."""
        if not self.packed:
            return x_bt
        tokens, rows, cols = self._on(x_bt.device)
        flat = x_bt.reshape(-1, *x_bt.shape[2:])[tokens]
        out = x_bt.new_zeros((*self.shape, *x_bt.shape[2:]))
        return out.index_put((rows, cols), flat)

    def to_batch(self, x_nw: torch.Tensor, like_bt: torch.Tensor) -> torch.Tensor:
        """The inverse: rows ``[n, w, ...]`` back at their positions in a tensor shaped like ``like_bt`` ``[b, s]``
        (zeros on the padding), or ``x_nw`` itself (padded)."""
        if not self.packed:
            return x_nw
        tokens, rows, cols = self._on(x_nw.device)
        out = x_nw.new_zeros((like_bt.numel(), *x_nw.shape[2:]))
        out[tokens] = x_nw[rows, cols]
        return out.reshape(*like_bt.shape, *x_nw.shape[2:])

    def per_sequence(self, x_n: torch.Tensor) -> torch.Tensor:
        """A per-sequence tensor ``[n, ...]`` aligned with the rows (the empty micro-batch's row gets zeros)."""
        if not self.packed or self.sequences:
            return x_n
        return x_n.new_zeros((1, *x_n.shape[1:]))

    def _on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._index:
            self._index[device] = tuple(t.to(device) for t in (self._tokens, self._rows, self._cols))
        return self._index[device]


def sequences_with_tokens(batch: Mapping[str, torch.Tensor], mask_key: str = "loss_mask") -> torch.Tensor:
    """0-d count of the micro-batch's sequences with at least one ``mask_key`` token (either layout)."""
    return SequenceView(batch)(batch[mask_key]).bool().any(dim=-1).sum()
