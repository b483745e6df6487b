"""Per-token log-probabilities of the labels and policy entropy from vocab-parallel logits, memory-lean.

A naive ``log_softmax(logits.float())`` plus entropy keeps several fp32 ``[tokens × vocab]`` tensors alive
through forward and backward (at vocab 151,936 that is ~0.6 GB per 1,000 tokens each). Here the tokens are
processed in chunks: each chunk is upcast to fp32 alone, reduced to four numbers per token, and dropped.
Backward recomputes the chunk's softmax from the saved per-token ``logsumexp`` and writes the gradient wrt the
logits chunk by chunk in the logits' dtype. What stays alive between forward and backward is the logits
(which the caller holds anyway) and three fp32 values per token.

Vocab parallelism (Megatron's ``VocabParallelCrossEntropy`` pattern): each tensor-parallel rank holds the logits
of a contiguous vocab shard ``[rank · V/tp, (rank+1) · V/tp)``. Per chunk, one MAX all-reduce gives the global
max ``m``, then one SUM all-reduce of ``[Σ e^u, Σ e^u·u, u_label]`` (``u = x − m``, zero on ranks that do not
own the label) gives everything else:

    logsumexp = m + log Σ e^u,   logp = u_label − log Σ e^u,   entropy = log Σ e^u − Σ e^u·u / Σ e^u.

The gradient needs no communication: with ``p = softmax(x)``, ``x = logits / T``,

    ∂logp/∂x_j = 1[j = label] − p_j,   ∂H/∂x_j = −p_j (log p_j + H),

and both only involve this rank's shard plus the per-token globals ``logsumexp`` and ``H``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

DEFAULT_CHUNK_TOKENS = 1024


class _MegatronGroup:
    """Type of :data:`MEGATRON_GROUP`."""

    def __repr__(self) -> str:
        return "MEGATRON_GROUP"


MEGATRON_GROUP = _MegatronGroup()
"""Default of every ``*_group`` argument: Megatron's group of that kind once its parallel state exists, else
none (``None``: no collective, the tensors are whole)."""

GroupArg = dist.ProcessGroup | _MegatronGroup | None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: GroupArg = MEGATRON_GROUP,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` and (optionally) entropies under ``softmax(logits / temperature)``.

    ``logits``: ``[..., V/tp]`` this rank's vocab shard, any float dtype; ``labels``: ``[...]`` global token
    ids (ids outside ``[0, V)``, e.g. ``-100``, give a finite but meaningless log-prob; mask them).
    Returns fp32 ``logp [...]`` and ``entropy [...]`` (``None`` when ``with_entropy`` is False; fp64 for fp64
    logits, so ``gradcheck`` can verify the math); both are differentiable wrt ``logits``.

    ``tp_group``: the group the vocab is split over; by default Megatron's tensor-parallel group when
    Megatron's parallel state is initialised, else none. ``None`` means the logits hold the whole vocabulary.
    ``chunk_tokens``: tokens per fp32 working chunk (scratch ≈ 2 · chunk_tokens · V/tp · 4 bytes).
    ``inplace_backward``: write the gradient into the logits' own storage (saves one ``[tokens × V/tp]``
    tensor in the logits' dtype); only valid when nothing else needs the logits' values after this
    function's backward – true for the logits a Megatron ``GPTModel`` returns to a loss function. The write
    bumps the logits' version counter, so an autograd node that saved them fails loudly instead of reading
    the gradient.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)} minus vocab"
        )
    if inplace_backward and not logits.is_contiguous():
        raise ValueError("inplace_backward needs contiguous logits")
    group = _resolve_group(tp_group)
    outputs = _VocabParallelLogprobs.apply(
        logits, labels, group, float(temperature), bool(with_entropy), int(chunk_tokens), inplace_backward
    )
    if with_entropy:
        logp, entropy = outputs
        return logp, entropy
    return outputs, None


def _resolve_group(tp_group: GroupArg) -> dist.ProcessGroup | None:
    if not isinstance(tp_group, _MegatronGroup):
        return tp_group
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _local_labels(labels_n: torch.Tensor, shard_size: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels as indices into this rank's shard (0 where not owned) and the ``owned`` mask, both ``[n]``."""
    _, rank = _group_size_rank(group)
    start = rank * shard_size
    owned_n = (labels_n >= start) & (labels_n < start + shard_size)
    return torch.where(owned_n, labels_n - start, 0), owned_n


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 and narrower logits; fp64 stays fp64 (so ``gradcheck`` can check the math)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scaled_upcast(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """``chunk / T`` in the compute dtype, always a new tensor (a bare ``.float()`` of fp32 logits aliases)."""
    dtype = _compute_dtype(chunk.dtype)
    if temperature == 1.0:
        return chunk.to(dtype, copy=True)
    return chunk.div(temperature) if chunk.dtype == dtype else chunk.to(dtype).div_(temperature)


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, temperature, with_entropy, chunk_tokens, inplace_backward):
        shard_size = logits.shape[-1]
        logits_nv = logits.reshape(-1, shard_size)
        labels_n = labels.reshape(-1).long()
        local_n, owned_n = _local_labels(labels_n, shard_size, group)
        num_tokens = logits_nv.shape[0]
        logp_n = torch.empty(num_tokens, dtype=_compute_dtype(logits.dtype), device=logits.device)
        lse_n = torch.empty_like(logp_n)
        entropy_n = torch.empty_like(logp_n) if with_entropy else None
        world, _ = _group_size_rank(group)
        for start in range(0, num_tokens, chunk_tokens):
            end = min(start + chunk_tokens, num_tokens)
            rows = slice(start, end)
            lse, logp, entropy = _chunk_forward(
                logits_nv[rows], local_n[rows], owned_n[rows], temperature, with_entropy, group, world
            )
            lse_n[rows], logp_n[rows] = lse, logp
            if entropy_n is not None:  # with_entropy
                entropy_n[rows] = entropy
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, local_n, owned_n, lse_n, entropy_n)
        ctx.params = (temperature, chunk_tokens, inplace_backward)
        shape = labels.shape
        if entropy_n is not None:  # with_entropy
            return logp_n.view(shape), entropy_n.view(shape)
        return logp_n.view(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy=None):
        logits, local_n, owned_n, lse_n, entropy_n = ctx.saved_tensors
        temperature, chunk_tokens, inplace_backward = ctx.params
        if grad_logp is None and grad_entropy is None:
            return (None,) * 7
        shard_size = logits.shape[-1]
        logits_nv = logits.view(-1, shard_size) if inplace_backward else logits.reshape(-1, shard_size)
        grad_nv = logits_nv if inplace_backward else torch.empty_like(logits_nv)
        g_logp_n = None if grad_logp is None else grad_logp.reshape(-1).to(lse_n.dtype)
        g_ent_n = None if grad_entropy is None else grad_entropy.reshape(-1).to(lse_n.dtype)
        for start in range(0, logits_nv.shape[0], chunk_tokens):
            rows = slice(start, min(start + chunk_tokens, logits_nv.shape[0]))
            grad_nv[rows] = _chunk_backward(
                logits_nv[rows],
                local_n[rows],
                owned_n[rows],
                lse_n[rows],
                None if entropy_n is None else entropy_n[rows],
                None if g_logp_n is None else g_logp_n[rows],
                None if g_ent_n is None else g_ent_n[rows],
                temperature,
            )
        return grad_nv.view(logits.shape), None, None, None, None, None, None


def _chunk_forward(logits_cv, local_c, owned_c, temperature, with_entropy, group, world):
    """Per-token ``(logsumexp, logp, entropy|None)`` of one chunk, reduced over the vocab shards."""
    u_cv = _scaled_upcast(logits_cv, temperature)
    max_c = u_cv.amax(dim=-1)
    if world > 1:
        dist.all_reduce(max_c, op=dist.ReduceOp.MAX, group=group)
    u_cv.sub_(max_c[:, None])
    rows = torch.arange(u_cv.shape[0], device=u_cv.device)
    u_label_c = torch.where(owned_c, u_cv[rows, local_c], 0.0)
    if with_entropy:
        exp_cv = u_cv.exp()
        # Σ e^u·u, in place over u (no longer needed); not a matmul, which TF32 settings would truncate.
        terms = [exp_cv.sum(dim=-1), u_label_c, u_cv.mul_(exp_cv).sum(dim=-1)]
        del exp_cv
    else:
        terms = [u_cv.exp_().sum(dim=-1), u_label_c]
    del u_cv
    stacked = torch.stack(terms)
    if world > 1:
        dist.all_reduce(stacked, group=group)
    log_sum_exp_c = stacked[0].log()
    logp_c = stacked[1] - log_sum_exp_c
    entropy_c = log_sum_exp_c - stacked[2] / stacked[0] if with_entropy else None
    return max_c + log_sum_exp_c, logp_c, entropy_c


def _chunk_backward(logits_cv, local_c, owned_c, lse_c, entropy_c, g_logp_c, g_ent_c, temperature):
    """Gradient wrt one chunk of logits (compute dtype):
    ``(g_logp·(1[label] − p) − g_ent·p·(log p + H)) / T``."""
    logq_cv = _scaled_upcast(logits_cv, temperature).sub_(lse_c[:, None])  # log p
    if g_ent_c is None:
        grad_cv = logq_cv.exp_().mul_(-g_logp_c[:, None])
    else:
        p_cv = logq_cv.exp()
        # −p·(g_logp + g_ent·(log p + H)), reusing the log p buffer for the bracket.
        bracket_cv = logq_cv.mul_(g_ent_c[:, None]).add_((g_ent_c * entropy_c)[:, None])
        if g_logp_c is not None:
            bracket_cv.add_(g_logp_c[:, None])
        grad_cv = p_cv.mul_(bracket_cv).neg_()
        del logq_cv, bracket_cv
    if g_logp_c is not None:
        rows = torch.arange(grad_cv.shape[0], device=grad_cv.device)
        grad_cv[rows, local_c] += torch.where(owned_c, g_logp_c, 0.0)
    if temperature != 1.0:
        grad_cv.div_(temperature)
    return grad_cv
