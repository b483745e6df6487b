"""Chunked vocab-parallel log-probs and entropy against a naive full-vocabulary fp32 ``log_softmax``: values,
gradients of both outputs, dtypes, chunkings, temperature, masked tokens, float64 gradcheck, in-place backward."""

from __future__ import annotations

import pytest
import torch

from sapo_megatron.megatron.logprobs import vocab_parallel_logprobs

VALUE_ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5}  # both compare fp32 math on the same inputs
GRAD_ATOL = {torch.float32: 2e-6, torch.bfloat16: 4e-3}  # bf16: one rounding of the fp32 gradient


def naive(logits, labels, temperature=1.0):
    """The reference: fp32 ``log_softmax`` over the whole vocabulary."""
    lsm = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = lsm.gather(-1, labels.clamp(0, logits.shape[-1] - 1)[..., None])[..., 0]
    return logp, -(lsm.exp() * lsm).sum(-1)


def make_inputs(dtype, batch=3, seq=11, vocab=97, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, vocab, generator=gen) * 3.0).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[0, 7:] = False
    mask[2, :3] = False
    g_logp, g_ent = torch.randn(batch, seq, generator=gen), torch.randn(batch, seq, generator=gen)
    return logits, labels, mask, g_logp, g_ent


def grads(fn, logits, labels, mask, g_logp, g_ent, **kwargs):
    """Values and the gradient wrt logits of ``Σ mask·(g_logp·logp + g_ent·H)``."""
    leaf = logits.clone().requires_grad_()
    logp, entropy = fn(leaf, labels, **kwargs)
    objective = torch.where(mask, g_logp * logp + g_ent * entropy, 0.0).sum()
    objective.backward()
    return logp.detach(), entropy.detach(), leaf.grad


def chunked(logits, labels, **kwargs):
    return vocab_parallel_logprobs(logits, labels, tp_group=None, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 33, 4096], ids=["chunk1", "chunk5", "chunk-all", "chunk-big"])
def test_values_and_gradients_match_naive(dtype, chunk_tokens):
    inputs = make_inputs(dtype)
    ref_logp, ref_ent, ref_grad = grads(naive, *inputs)
    logp, ent, grad = grads(chunked, *inputs, chunk_tokens=chunk_tokens)
    assert logp.dtype == ent.dtype == torch.float32
    assert grad.dtype == dtype
    torch.testing.assert_close(logp, ref_logp, atol=VALUE_ATOL[dtype], rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=VALUE_ATOL[dtype], rtol=0)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=GRAD_ATOL[dtype], rtol=0)


def test_masked_tokens_get_zero_gradient():
    logits, labels, mask, g_logp, g_ent = make_inputs(torch.float32)
    _, _, grad = grads(chunked, logits, labels, mask, g_logp, g_ent, chunk_tokens=4)
    assert grad[~mask].abs().max() == 0
    assert grad[mask].abs().amax(-1).min() > 0


@pytest.mark.parametrize("temperature", [0.6, 1.3])
def test_temperature_scales_logits(temperature):
    inputs = make_inputs(torch.float32)
    ref = grads(naive, *inputs, temperature=temperature)
    got = grads(chunked, *inputs, temperature=temperature, chunk_tokens=7)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    at_one = grads(chunked, *inputs, chunk_tokens=7)
    assert (got[0] - at_one[0]).abs().max() > 1e-2  # the setting changes the result


@pytest.mark.parametrize("which", ["logp", "entropy", "both"])
def test_float64_gradcheck(which):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, dtype=torch.float64, generator=gen).requires_grad_()
    labels = torch.randint(0, 7, (2, 3), generator=gen)

    def fn(z):
        logp, entropy = vocab_parallel_logprobs(z, labels, tp_group=None, temperature=0.8, chunk_tokens=4)
        return {"logp": logp, "entropy": entropy, "both": (logp, entropy)}[which]

    assert torch.autograd.gradcheck(fn, (logits,))


def test_without_entropy_and_logp_only_gradient():
    logits, labels, mask, g_logp, _ = make_inputs(torch.float32)
    leaf = logits.clone().requires_grad_()
    logp, entropy = vocab_parallel_logprobs(leaf, labels, tp_group=None, with_entropy=False, chunk_tokens=6)
    assert entropy is None
    torch.where(mask, g_logp * logp, 0.0).sum().backward()
    ref = logits.clone().requires_grad_()
    torch.where(mask, g_logp * naive(ref, labels)[0], 0.0).sum().backward()
    torch.testing.assert_close(leaf.grad, ref.grad, atol=2e-6, rtol=0)


def test_entropy_only_gradient():
    logits, labels, mask, _, g_ent = make_inputs(torch.float32)
    zeros = torch.zeros_like(g_ent)
    _, _, ref_grad = grads(naive, logits, labels, mask, zeros, g_ent)
    leaf = logits.clone().requires_grad_()
    _, entropy = chunked(leaf, labels, chunk_tokens=8)
    torch.where(mask, g_ent * entropy, 0.0).sum().backward()
    torch.testing.assert_close(leaf.grad, ref_grad, atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inplace_backward_matches_and_reuses_the_logits_storage(dtype):
    logits, labels, mask, g_logp, g_ent = make_inputs(dtype)
    ref = grads(chunked, logits, labels, mask, g_logp, g_ent, chunk_tokens=5)
    leaf = logits.clone().requires_grad_()
    model_logits = leaf * 1.0  # a non-leaf, like a model's output
    logp, entropy = chunked(model_logits, labels, chunk_tokens=5, inplace_backward=True)
    torch.where(mask, g_logp * logp + g_ent * entropy, 0.0).sum().backward()
    torch.testing.assert_close(leaf.grad, ref[2], atol=0, rtol=0)
    torch.testing.assert_close(model_logits.detach(), ref[2], atol=0, rtol=0)  # the gradient took its place


def test_inplace_backward_fails_loudly_when_another_node_needs_the_logits():
    logits, labels, *_ = make_inputs(torch.float32)
    model_logits = logits.clone().requires_grad_() * 1.0
    other = (model_logits * model_logits).sum()  # saves the logits for its own backward
    logp, _ = chunked(model_logits, labels, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (logp.sum() + other).backward()


def test_labels_outside_vocab_stay_finite():
    logits, labels, *_ = make_inputs(torch.float32)
    labels[0, 0], labels[1, 1] = -100, 10_000
    leaf = logits.clone().requires_grad_()
    logp, entropy = chunked(leaf, labels, chunk_tokens=4)
    (logp.sum() + entropy.sum()).backward()
    assert torch.isfinite(logp).all() and torch.isfinite(leaf.grad).all()


def test_errors_name_the_problem():
    logits, labels, *_ = make_inputs(torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        chunked(logits, labels, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked(logits, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="labels"):
        chunked(logits, labels[:, :-1])
    with pytest.raises(ValueError, match="contiguous"):
        chunked(logits.transpose(0, 1), labels.transpose(0, 1), inplace_backward=True)
