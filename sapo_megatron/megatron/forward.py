"""Forward-only passes outside the train step: full-vocabulary logits under any parallel layout (the logit-parity
check of :mod:`sapo_megatron.conversion.verify`, and tests)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from sapo_megatron.megatron.context_parallel import batch_shards, gather_tokens
from sapo_megatron.megatron.packed_seq import model_inputs


@torch.no_grad()
def forward_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, **vision: torch.Tensor
) -> torch.Tensor | None:
    """Logits ``[b, s, vocab]`` (float32) for ``input_ids [b, s]`` through the pipeline schedule; returned on
    the last pipeline stage (gathered over tensor parallelism), ``None`` on the other stages. A
    vision-language model also takes ``pixel_values`` and ``image_grid_thw``."""
    model.eval()
    batch, seq = input_ids.shape

    shards = batch_shards({"input_ids": input_ids})  # CP: this rank's chunks in, whole sequences out

    def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = tensor_parallel.gather_from_tensor_model_parallel_region(logits).float()
        return torch.zeros((), device=logits.device), gather_tokens(full, shards)

    def forward_step(data_iterator: Iterator[torch.Tensor], chunk: torch.nn.Module):
        ids = next(data_iterator)
        if shards is not None:
            with model_inputs(chunk, {"input_ids": ids, **vision}) as inputs:
                return chunk(**inputs), loss_func
        positions = torch.arange(seq, device=ids.device).expand_as(ids)
        images = {k: v.to(ids.device) for k, v in vision.items()}
        return chunk(ids, positions, attention_mask=None, **images), loss_func

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([input_ids.to(device)]),
        model=[model],
        num_microbatches=1,
        seq_length=seq,
        micro_batch_size=batch,
        forward_only=True,
    )
    return outputs[0] if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None
