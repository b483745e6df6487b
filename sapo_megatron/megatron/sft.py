"""Supervised (next-token cross-entropy) loss as a :data:`~sapo_megatron.megatron.train_step.LossFn`."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from sapo_megatron.megatron.context_parallel import batch_shards, gather_tokens, shard_tokens
from sapo_megatron.megatron.train_step import Metrics, MicroBatch


def sft_loss(logits_bsv: torch.Tensor, batch: MicroBatch) -> tuple[torch.Tensor, Metrics]:
    """Token-mean cross-entropy over ``loss_mask``, normalised by ``batch["num_tokens_global"]``.

    ``labels`` [b, s] holds the next token of each position; ``loss_mask`` [b, s] marks the positions that count.
    """
    shards = batch_shards(batch)  # CP: the logits hold this rank's chunks; the NLL is gathered back whole
    nll_bs = gather_tokens(
        vocab_parallel_cross_entropy(logits_bsv.float(), shard_tokens(batch["labels"], shards)), shards
    )
    mask_bs = batch["loss_mask"].float()
    nll_sum = (nll_bs * mask_bs).sum()
    loss = nll_sum / batch["num_tokens_global"].float()
    tokens = mask_bs.sum()
    return loss, {"sft/nll": torch.stack([nll_sum.detach(), tokens])}
