"""The decoupled objective of asynchronous RL (AReaL, Fu et al. 2025, arXiv:2505.24298) and the staleness of
tokens (docs/async.md).

Three policies meet in a step of a fully asynchronous run:

- the *behaviour* policy ``π_b``: the weights that sampled each token – its log-prob is the engine's
  (``rollout_logp``), its version ``v_b`` travels with the token (``MicroBatch.versions``);
- the *proximal* policy ``π_prox``: the trainer's weights at the start of the step (version ``v``), whose log-probs
  the old-policy pass recomputes (``old_logp``);
- the *current* policy ``π_θ``, being optimised.

``L = agg( w_t · l(r_t, A_t) )`` with ``r_t = π_θ / π_prox`` – the ratio that SAPO's gate or GRPO's / GSPO's clip
sees – and ``w_t = correct(π_prox / π_b)`` the detached truncated importance weight of the configured
:mod:`~sapo_megatron.algo.mismatch` correction (TIS: ``min(w, C)``; IcePop: ``w`` inside ``[low, high]``, else
0). That is exactly what every policy loss's ``compute`` does when ``old_logp`` is the proximal log-prob and
``rollout_logp`` the behaviour log-prob, so :func:`decoupled_loss` names that pairing rather than re-deriving it.

Proximal approximation (AReaL's ``prox_logp_method: loglinear``): with ``s_t = v − v_b`` the token's staleness,
``log π_prox ≈ log π_b + α_t (log π_θ − log π_b)``, ``α_t = s_t / (s_t + 1)`` (the current policy counts as version
``v + 1``), with ``log π_θ`` detached: the old-policy forward pass is skipped. An on-policy token (``s = 0``) gets
``π_prox = π_b``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sapo_megatron.algo.loss_registry import PolicyLoss
from sapo_megatron.algo.metric import MetricSet, Reduce
from sapo_megatron.algo.mismatch import MismatchCorrection


def loglinear_proximal_logp(
    behaviour_logp_bt: torch.Tensor, logp_bt: torch.Tensor, staleness_bt: torch.Tensor
) -> torch.Tensor:
    """``[b, s]`` approximate proximal log-probs, detached: ``log π_b + s/(s+1) · (sg[log π_θ] − log π_b)``.
    ``staleness_bt`` holds each token's versions behind the trainer (≥ 0; negative values count as 0)."""
    s_bt = staleness_bt.float().clamp(min=0.0)
    alpha_bt = s_bt / (s_bt + 1.0)
    behaviour = behaviour_logp_bt.detach().float()
    return (behaviour + alpha_bt * (logp_bt.detach().float() - behaviour)).detach()


def decoupled_loss(
    loss: PolicyLoss,
    logp_bt: torch.Tensor,
    proximal_logp_bt: torch.Tensor,
    behaviour_logp_bt: torch.Tensor,
    adv: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    correction: MismatchCorrection,
    **kwargs,
) -> tuple[torch.Tensor, MetricSet]:
    """The decoupled objective: ``loss``'s ratio is ``π_θ / π_prox`` and its per-token loss is multiplied by
    ``correction``'s weight of ``π_prox / π_b``. Other keyword arguments (normalisers, reference log-probs,
    entropy) go to ``loss.compute``."""
    return loss.compute(
        logp_bt,
        proximal_logp_bt,
        adv,
        mask_bt,
        rollout_logp_bt=behaviour_logp_bt,
        correction=correction,
        **kwargs,
    )


def staleness_metrics(per_sample: Sequence[Sequence[int]], buckets: int) -> MetricSet:
    """Staleness (versions behind the trainer) of the trained tokens, ``per_sample[i]`` one value per trained
    token of sample ``i``: ``staleness/token_mean``, ``token_max``, ``sample_mean`` and ``sample_max`` (a sample's
    staleness is its oldest token's: the one the bound checks), and ``staleness/tokens_<k>`` for ``k`` in ``0..buckets`` (the
    share of tokens exactly ``k`` behind; the last bucket also holds those further behind)."""
    tokens = torch.tensor([v for sample in per_sample for v in sample], dtype=torch.float64)
    samples = [torch.tensor(list(sample), dtype=torch.float64) for sample in per_sample if len(sample)]
    metrics = MetricSet()
    if tokens.numel() == 0:
        return metrics
    sample_b = torch.stack([sample.max() for sample in samples])
    metrics.add("staleness/token_mean", float(tokens.mean()), Reduce.TOKEN_MEAN)
    metrics.add("staleness/token_max", float(tokens.max()), Reduce.MAX)
    metrics.add("staleness/sample_mean", float(sample_b.mean()), Reduce.SEQUENCE_MEAN)
    metrics.add("staleness/sample_max", float(sample_b.max()), Reduce.MAX)
    capped = tokens.clamp(max=buckets)
    for k in range(buckets + 1):
        metrics.add(f"staleness/tokens_{k}", float((capped == k).double().mean()), Reduce.TOKEN_MEAN)
    return metrics


def partial_sample_metrics(per_sample_versions: Sequence[Sequence[int]]) -> MetricSet:
    """Partial rollouts among the trained samples, ``per_sample_versions[i]`` the policy version of each response
    token of sample ``i``: ``async/partial_samples_frac`` (the share of samples whose tokens come from more than one
    version: they spanned a weight update) and ``async/partial_tokens_frac`` (the share of tokens of such
    samples that a later version made than the sample's first token)."""
    metrics = MetricSet()
    samples = [list(v) for v in per_sample_versions if len(v)]
    if not samples:
        return metrics
    partial = [len(set(v)) > 1 for v in samples]
    later = sum(sum(1 for x in v if x > v[0]) for v in samples)
    metrics.add("async/partial_samples_frac", sum(partial) / len(samples), Reduce.SEQUENCE_MEAN)
    metrics.add("async/partial_tokens_frac", later / sum(len(v) for v in samples), Reduce.TOKEN_MEAN)
    return metrics
