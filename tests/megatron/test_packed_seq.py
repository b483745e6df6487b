"""What a packed micro-batch hands Megatron-Core, checked on CPU against Megatron's own code (no process group):
the THD ``PackedSeqParams`` (cu_seqlens with each sequence padded to the TP multiple, max_seqlen) for the
Transformer Engine path; for the local path, the block-diagonal causal mask through Megatron's masked softmax
(per-sequence causal attention, exact zeros across sequences) and RoPE restarting per sequence exactly as
Megatron's THD RoPE (``_apply_rotary_pos_emb_thd`` on those cu_seqlens) applies it."""

from __future__ import annotations

# megatron-core 0.19 imports triton at import time unless sapo_megatron's stand-ins are registered first
import sapo_megatron.megatron  # noqa: F401  # isort: skip

import itertools

import pytest
import torch
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import attention_mask_func

from sapo_megatron.megatron import packed_seq
from sapo_megatron.model.batching import TrainSequence, to_packed_tensors
from sapo_megatron.model.packing import POSITION_IDS

# model positions 5, 2, 3 under TP2 + SP: slots 6, 2, 4, then 2 tokens of tail padding (T = 14)
SEQS = [TrainSequence([1, 2, 3], [4, 5, 6]), TrainSequence([7], [8, 9]), TrainSequence([1, 2], [3, 4])]
BATCH = to_packed_tensors(SEQS, length=14, pad_id=0, multiple=2)


class _OneRankGroup:
    """What Megatron's RoPE asks of a context-parallel group of size 1."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def test_thd_params_for_tensor_parallel_sequence_parallel_padding():
    assert BATCH[POSITION_IDS].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 0, 1, 2, 3, 0, 1]]
    params = packed_seq.thd_params(BATCH[POSITION_IDS])
    assert params.qkv_format == "thd"
    for cu in (
        params.cu_seqlens_q,
        params.cu_seqlens_kv,
        params.cu_seqlens_q_padded,
        params.cu_seqlens_kv_padded,
    ):
        assert cu.dtype == torch.int32 and cu.tolist() == [0, 6, 8, 12, 14]
        assert all(int(b - a) % 2 == 0 for a, b in itertools.pairwise(cu))  # every segment a multiple of tp
    assert params.max_seqlen_q == params.max_seqlen_kv == 6
    assert isinstance(params.max_seqlen_q, int)


def test_model_inputs_of_the_transformer_engine_path(monkeypatch):
    monkeypatch.setattr(packed_seq, "uses_local_attention", lambda model: False)
    with packed_seq.model_inputs(torch.nn.Module(), BATCH) as inputs:
        assert inputs["attention_mask"] is None
        assert inputs["packed_seq_params"].cu_seqlens_q.tolist() == [0, 6, 8, 12, 14]
        assert inputs["position_ids"] is BATCH[POSITION_IDS]
    padded = {"input_ids": torch.zeros(2, 5, dtype=torch.long)}
    with packed_seq.model_inputs(torch.nn.Module(), padded) as inputs:  # padded: as before packing existed
        assert inputs["attention_mask"] is None and "packed_seq_params" not in inputs
        assert inputs["position_ids"].tolist() == [list(range(5))] * 2


def test_block_causal_mask_values():
    mask = packed_seq.block_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    allowed = (~mask[0, 0]).int().tolist()
    assert mask.shape == (1, 1, 6, 6)
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]


def test_megatron_masked_softmax_with_the_block_mask_is_per_sequence_causal_attention():
    """Megatron's local attention softmax (fusion off, as the model is built) takes the given mask instead of its
    causal one: each query attends causally within its own segment, with exact zeros elsewhere."""
    softmax = FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=False,
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=None,
    )
    scores = torch.randn(1, 3, 14, 14, generator=torch.Generator().manual_seed(0)) * 4
    probs = softmax(scores.clone(), packed_seq.block_causal_mask(BATCH[POSITION_IDS]))
    bounds = packed_seq.segment_bounds(BATCH[POSITION_IDS]).tolist()
    for start, end in itertools.pairwise(bounds):
        block = scores[..., start:end, start:end]
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        want = torch.softmax(block.masked_fill(~causal, float("-inf")), dim=-1)
        torch.testing.assert_close(probs[..., start:end, start:end], want, atol=1e-6, rtol=0)
        outside = torch.ones(14, dtype=torch.bool)
        outside[start:end] = False
        assert (probs[..., start:end, outside] == 0).all()  # exactly: -10000 underflows in fp32


def _rope_table(length: int) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` without its move to CUDA: ``[length, 1, 1, dim]``."""
    freqs = RotaryEmbedding(
        kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True
    ).get_freqs_non_repeated(length)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def test_local_rope_restarts_per_sequence_exactly_like_megatron_thd_rope():
    position_ids = BATCH[POSITION_IDS]
    t = torch.randn(14, 2, 8, generator=torch.Generator().manual_seed(1))  # [T, heads, head_dim]
    params = packed_seq.thd_params(position_ids)
    thd = rope_utils._apply_rotary_pos_emb_thd(
        t, params.cu_seqlens_q, _rope_table(params.max_seqlen_q), cp_group=_OneRankGroup()
    )
    # local path: GPTModel's table over the whole row, re-indexed by the hook, applied as bshd (b = 1)
    hook = packed_seq.rope_at_positions(position_ids)
    freqs = hook(None, (), _rope_table(14))
    assert freqs.shape == (14, 1, 1, 8)
    local = rope_utils._apply_rotary_pos_emb_bshd(t[:, None], freqs)[:, 0]
    torch.testing.assert_close(local, thd, atol=0, rtol=0)
    # not vacuous: without the restart (positions 0..T-1 across the row) tokens after the first slot rotate
    # by other angles
    unrestarted = rope_utils._apply_rotary_pos_emb_bshd(t[:, None], _rope_table(14))[:, 0]
    assert (unrestarted[6:] - thd[6:]).abs().max() > 0.1
    torch.testing.assert_close(unrestarted[:6], thd[:6], atol=0, rtol=0)


def test_packed_rows_must_be_single_rows():
    with pytest.raises(ValueError, match=r"one row \[1, T\]"):
        packed_seq.segment_bounds(torch.zeros(2, 4, dtype=torch.long))
