"""The RL policy loss as a Megatron loss hook: :class:`PolicyLossHook` for ``TrainEngine.train_step``,
:class:`LogprobOutput` for ``TrainEngine.forward_only`` (old-policy and reference log-probs), and
:func:`add_global_normalisers` for the batch-wide normalisers every micro-batch needs.

Micro-batch keys the hook reads (all ``[b, s]`` unless noted, aligned with ``labels``, right-padded):

- ``labels``: the next token of each position; ``loss_mask``: 1 on response tokens that count;
- ``old_logp``: log-probs of ``labels`` under the parameters that produced the rollout batch;
- ``advantages``: ``[b]`` (one per sequence) or ``[b, s]`` (token-level, e.g. OPD);
- optional ``rollout_logp`` (the engine's log-probs: mismatch correction and metrics) and ``ref_logp``
  (the reference policy's, for ``kl_coef``); masked positions may hold anything, NaN included;
- ``num_sequences_global`` / ``num_tokens_global``: 0-d counts over *all* micro-batches and data-parallel
  ranks of this optimizer step (:func:`add_global_normalisers` computes them).

With the global normalisers each micro-batch returns its exact share of the full-batch loss, so the step does
not depend on the micro-batch split or the data/pipeline layout (tests/loss prove it). A sequence must stay
within one micro-batch. Context parallelism (``parallel.cp > 1``): the logits hold this CP rank's chunks of each
sequence; log-probs and entropy are computed on them and gathered back into whole sequences on every CP rank
(:func:`~sapo_megatron.megatron.context_parallel.gather_tokens`, whose backward keeps this rank's tokens), so
every aggregation mode, sequence-level ratio and metric below sees whole sequences.

Packed micro-batches (one row ``[1, T]`` holding several sequences, ``segment_ids``; :mod:`sapo_megatron.model.packing`):
log-probs and entropy are computed on the packed logits, then every per-token tensor (any key shaped like
``labels``) is viewed as per-sequence rows ``[n, w]`` (:class:`~sapo_megatron.model.packing.SequenceView`) before the
loss, so sequence means, sequence-level ratios and sequence counts are per sequence, not per row; per-sequence
keys (``advantages`` ``[n]``) already are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from pydantic import TypeAdapter

from sapo_megatron.algo import (
    MismatchCorrection,
    MismatchCorrectionConfig,
    NoCorrection,
    PolicyLoss,
    build_policy_loss,
    correction_batch_sums,
    opd_k3,
)
from sapo_megatron.algo.decoupled import loglinear_proximal_logp
from sapo_megatron.algo.losses import LOG_RATIO_CLAMP
from sapo_megatron.algo.metric import MetricSet, Reduce
from sapo_megatron.megatron.context_parallel import batch_shards, gather_tokens, shard_tokens
from sapo_megatron.megatron.logprobs import (
    DEFAULT_CHUNK_TOKENS,
    MEGATRON_GROUP,
    GroupArg,
    _MegatronGroup,
    vocab_parallel_logprobs,
)
from sapo_megatron.megatron.train_step import Metrics, TaggedMetrics
from sapo_megatron.model.packing import SequenceView, sequences_with_tokens
from sapo_megatron.model.step_batch import MicroBatch

NORMALISER_KEYS = ("num_sequences_global", "num_tokens_global")
IS_WEIGHT_MEAN_KEY = "is_weight_mean_global"
"""0-d batch mean of a batch-normalised ``rollout_corr`` correction's IS weights (:func:`global_is_weight_mean`)."""

# Extrema cannot be combined from (weighted_sum, weight) pairs; the engine reports means and sums only.
_EXTREMA = (Reduce.MIN, Reduce.MAX)


class PolicyLossHook:
    """``(vocab_parallel_logits [b, s, V/tp], micro_batch) -> (loss contribution, metrics)`` for
    ``TrainEngine.train_step``.

    Log-probs and entropy come from :func:`~.logprobs.vocab_parallel_logprobs` in fp32 whatever the model's
    precision, at ``temperature`` (the rollout's sampling temperature). ``loss`` is a built policy loss or a
    mapping such as ``{"name": "sapo", "tau_neg": 1.05}``; it owns the aggregation mode and the KL / entropy
    coefficients. ``correction``: TIS / IcePop / none (needs ``rollout_logp`` in the batch unless none): with the
    old-policy log-probs as the proximal policy and the engine's as the behaviour policy, the loss is the
    decoupled objective (:mod:`sapo_megatron.algo.decoupled`). ``proximal_logp="loglinear"``: no ``old_logp`` is
    needed; the proximal log-probs are interpolated from ``rollout_logp``, the current log-probs and the batch's
    ``staleness``.

    Metrics, as ``(weighted_sum, weight)``, each weighted as its :class:`~sapo_megatron.algo.metric.Reduce`
    (given where the loss makes it) says: means by their token, sequence or sign-of-advantage count, so the
    engine reports the exact full-batch mean; sums (``loss/*``) so that the engine reports their *sum* over
    micro-batches and ranks (i.e. the full-batch value). Per-call extrema (``ratio/min``, ``ratio/max``) are
    left out: a (sum, weight) pair cannot carry them.

    Inputs (:class:`~sapo_megatron.model.step_batch.MicroBatch`): ``labels``, ``loss_mask``, ``advantages``,
    ``old_logp`` and the normalisers always; ``rollout_logp`` (mismatch metrics, TIS / IcePop), ``ref_logp``
    (KL to the reference) and ``teacher_logp`` (the student–teacher k3) when the step has them.

    ``inplace_backward`` (default on) lets the logits' storage receive their gradient, which saves one
    ``[tokens × V/tp]`` tensor; turn it off if something else keeps using the logits (it fails loudly if so).
    """

    def __init__(
        self,
        loss: PolicyLoss | Mapping[str, Any],
        correction: MismatchCorrection | Mapping[str, Any] | None = None,
        *,
        temperature: float = 1.0,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        log_entropy: bool = True,
        inplace_backward: bool = True,
        tp_group: GroupArg = MEGATRON_GROUP,
        proximal_logp: str = "recompute",
    ) -> None:
        if proximal_logp not in ("recompute", "loglinear"):
            raise ValueError(f"proximal_logp must be recompute or loglinear, got {proximal_logp!r}")
        self.proximal_logp = proximal_logp
        self.loss = build_policy_loss(loss)
        if correction is None:
            correction = NoCorrection()
        self.correction = TypeAdapter(MismatchCorrectionConfig).validate_python(correction)
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.with_entropy = log_entropy or self.loss.entropy_coef > 0
        # The logits a GPTModel hands to the loss are used by nothing else: their storage can take the gradient.
        self.inplace_backward = inplace_backward
        self.tp_group = tp_group
        self.ratios: list[torch.Tensor] = []  # per call, for the step's ratio quantiles (take_ratios)

    def __call__(self, logits: torch.Tensor, batch: MicroBatch) -> tuple[torch.Tensor, Metrics]:
        batch = MicroBatch.of(batch)  # tensors by name (a test's, a script's) read the same way
        device = logits.device
        labels = _get(batch, "labels", device)
        shards = batch_shards(batch)  # CP: the logits hold this rank's chunks of each sequence
        local_labels = shard_tokens(labels, shards)
        # Teachers score at temperature 1: the student's KL to them is taken there too (before the in-place
        # backward may reuse the logits' storage).
        distilling = batch.teacher_logp is not None
        logp_t1_bt = self._unit_temperature_logp(logits, local_labels) if distilling else None
        logp_t1_bt = None if logp_t1_bt is None else gather_tokens(logp_t1_bt, shards)
        logp_bt, entropy_bt = vocab_parallel_logprobs(
            logits,
            local_labels,
            tp_group=self.tp_group,
            temperature=self.temperature,
            with_entropy=self.with_entropy,
            chunk_tokens=self.chunk_tokens,
            inplace_backward=self.inplace_backward and logits.is_contiguous(),
        )
        logp_bt = gather_tokens(logp_bt, shards)
        entropy_bt = None if entropy_bt is None else gather_tokens(entropy_bt, shards)
        if entropy_bt is not None and self.loss.entropy_coef == 0:
            entropy_bt = entropy_bt.detach()  # logged only: backward then skips the entropy term
        view = _PerSequence(batch, labels.shape, device)  # packed rows → one row per sequence; else as is
        mask_bt = view.get("loss_mask").bool()
        num_sequences, num_tokens = (_get(batch, key, device) for key in NORMALISER_KEYS)
        adv = view.get("advantages")
        old_logp_bt = self._proximal(view, batch, logp_bt)
        loss, metrics = self.loss.compute(
            view(logp_bt),
            old_logp_bt,
            adv,
            mask_bt,
            rollout_logp_bt=view.optional(batch.rollout_logp),
            ref_logp_bt=view.optional(batch.ref_logp),
            entropy_bt=None if entropy_bt is None else view(entropy_bt),
            correction=self.correction,
            num_sequences=num_sequences,
            num_tokens=num_tokens,
            is_weight_mean=batch.extra.get(IS_WEIGHT_MEAN_KEY),
        )
        if distilling:
            student_bt = view(logp_bt if logp_t1_bt is None else logp_t1_bt).detach()
            k3 = opd_k3(student_bt, view.get("teacher_logp"), mask_bt)
            metrics.add("opd/student_teacher_k3", k3, Reduce.TOKEN_MEAN)
        self.ratios.append(_token_ratios(view(logp_bt), old_logp_bt, mask_bt))
        adv_bt = adv[:, None].expand(mask_bt.shape) if adv.dim() == 1 else adv
        return loss, _engine_metrics(metrics, _metric_weights(mask_bt, adv_bt, num_tokens))

    def _proximal(self, view: _PerSequence, batch: MicroBatch, logp_bt: torch.Tensor) -> torch.Tensor:
        """The proximal log-probs: the old-policy pass's, or (``loglinear``) interpolated between the engine's and
        the current ones by each token's staleness (0 where the batch has none), detached."""
        if self.proximal_logp == "recompute":
            return view.get("old_logp")
        behaviour = view.get("rollout_logp")
        staleness = view.optional(batch.staleness)
        return loglinear_proximal_logp(
            behaviour, view(logp_bt), torch.zeros_like(behaviour) if staleness is None else staleness
        )

    def take_ratios(self) -> list[torch.Tensor]:
        """The token ratios ``exp(logp − old_logp)`` (1-d, response tokens) of every call since the last take."""
        ratios, self.ratios = self.ratios, []
        return ratios

    def _unit_temperature_logp(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        if self.temperature == 1.0:
            return None  # the main log-probs already are at temperature 1
        with torch.no_grad():
            return unit_temperature_logprobs(logits, labels, self.tp_group, self.chunk_tokens)


def unit_temperature_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, tp_group: GroupArg, chunk_tokens: int
) -> torch.Tensor:
    """The log-probs of ``labels`` at temperature 1 from (detached) ``logits``: what the teachers score at, so
    what enters ``A_opd`` whatever the rollout temperature."""
    logp_bt, _ = vocab_parallel_logprobs(
        logits.detach(), labels, tp_group=tp_group, temperature=1.0, chunk_tokens=chunk_tokens
    )
    return logp_bt


class LogprobOutput:
    """``output_fn`` for ``TrainEngine.forward_only``: fp32 log-probs of ``batch["labels"]`` ``[b, s]`` at
    ``temperature`` (the old-policy pass of an RL step, or the reference pass at temperature 1), or, with
    ``with_entropy``, ``[2, b, s]`` holding log-probs and entropies (``logp, entropy = output``), or, with
    ``with_unit_temperature``, ``[2, b, s]`` holding the log-probs at ``temperature`` and at 1 (on-policy
    distillation sampled at temperature ≠ 1: ``A_opd`` compares the teacher's temperature-1 log-prob)."""

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        with_unit_temperature: bool = False,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        tp_group: GroupArg = MEGATRON_GROUP,
    ) -> None:
        if with_entropy and with_unit_temperature:
            raise ValueError("LogprobOutput: with_entropy and with_unit_temperature exclude each other")
        self.temperature = temperature
        self.with_entropy = with_entropy
        self.with_unit_temperature = with_unit_temperature
        self.chunk_tokens = chunk_tokens
        self.tp_group = tp_group

    def __call__(self, logits: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        shards = batch_shards(batch)  # CP: the logits hold this rank's chunks; the result is whole sequences
        labels = shard_tokens(_get(batch, "labels", logits.device), shards)
        logp_bt, entropy_bt = vocab_parallel_logprobs(
            logits.detach(),
            labels,
            tp_group=self.tp_group,
            temperature=self.temperature,
            with_entropy=self.with_entropy,
            chunk_tokens=self.chunk_tokens,
        )
        logp_bt = gather_tokens(logp_bt, shards)
        if self.with_unit_temperature:  # the same forward's logits at temperature 1 (what teachers score at)
            unit_bt = unit_temperature_logprobs(logits, labels, self.tp_group, self.chunk_tokens)
            return torch.stack((logp_bt, gather_tokens(unit_bt, shards)))
        if entropy_bt is not None:  # with_entropy
            return torch.stack((logp_bt, gather_tokens(entropy_bt, shards)))
        return logp_bt


def global_normalisers(
    micro_batches: Sequence[MicroBatch], *, dp_group: GroupArg = MEGATRON_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_sequences, num_tokens)``: fp64 0-d counts of sequences with at least one ``loss_mask`` token
    and of ``loss_mask`` tokens, over this rank's micro-batches summed over the data-parallel group (by
    default Megatron's, when its parallel state exists). Every rank of the group must call it."""
    if not micro_batches:
        raise ValueError("global_normalisers needs this rank's micro-batches (got none)")
    device = micro_batches[0]["loss_mask"].device
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in micro_batches:
        counts[0] += sequences_with_tokens(batch)  # packed: sequences, not rows
        counts[1] += batch["loss_mask"].bool().sum()
    group = _resolve_dp_group(dp_group)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return counts[0].clone(), counts[1].clone()


def add_global_normalisers(
    micro_batches: Sequence[MicroBatch], *, dp_group: GroupArg = MEGATRON_GROUP
) -> list[MicroBatch]:
    """Copies of ``micro_batches`` with ``num_sequences_global`` / ``num_tokens_global`` set (see
    :func:`global_normalisers`); call it once per optimizer step, on every rank, with that step's batches."""
    num_sequences, num_tokens = global_normalisers(micro_batches, dp_group=dp_group)
    return [
        MicroBatch.of(batch).copy(num_sequences_global=num_sequences, num_tokens_global=num_tokens)
        for batch in micro_batches
    ]


def global_is_weight_mean(
    correction: MismatchCorrection,
    micro_batches: Sequence[MicroBatch],
    *,
    dp_group: GroupArg = MEGATRON_GROUP,
) -> torch.Tensor | None:
    """0-d fp64 mean of a batch-normalised ``rollout_corr`` correction's truncated IS weights over these
    micro-batches (``old_logp``, ``rollout_logp``, ``loss_mask``; packed ones per sequence) and the data-parallel
    group: verl's ``rollout_is_batch_normalize`` over the step's whole batch. None when the correction does not
    normalise or a micro-batch has no ``old_logp`` (not the last pipeline stage). Every rank of the group that
    has them must call it."""
    sums = None
    for batch in micro_batches:
        if batch.old_logp is None or batch.rollout_logp is None:
            return None
        view = SequenceView(batch)
        part = correction_batch_sums(
            correction, view(batch.old_logp), view(batch.rollout_logp), view(batch["loss_mask"])
        )
        if part is None:
            return None
        sums = part if sums is None else sums + part.to(sums.device)
    if sums is None:
        return None
    group = _resolve_dp_group(dp_group)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    return sums[0] / sums[1].clamp(min=1)


class _PerSequence:
    """Micro-batch tensors on ``device``: per-token ones (shaped like ``labels``) as per-sequence rows, per-sequence
    ones (``[n]``) aligned with those rows."""

    def __init__(self, batch: MicroBatch, token_shape: torch.Size, device: torch.device) -> None:
        self.batch, self.token_shape, self.device = batch, token_shape, device
        self.view = SequenceView(batch)

    def __call__(self, x_bt: torch.Tensor) -> torch.Tensor:
        return self.view(x_bt)

    def get(self, key: str) -> torch.Tensor:
        return self._view(_get(self.batch, key, self.device))

    def optional(self, value: torch.Tensor | None) -> torch.Tensor | None:
        return None if value is None else self._view(value.to(self.device))

    def _view(self, value: torch.Tensor) -> torch.Tensor:
        if value.shape == self.token_shape:
            return self.view(value)
        return self.view.per_sequence(value) if value.dim() == 1 else value


def _metric_weights(
    mask_bt: torch.Tensor, adv_bt: torch.Tensor, num_tokens: torch.Tensor
) -> dict[Reduce, torch.Tensor]:
    """The count each kind of mean is taken over, and the sum's weight."""
    tokens = mask_bt.sum().double()
    return {
        Reduce.TOKEN_MEAN: tokens,
        Reduce.SEQUENCE_MEAN: mask_bt.any(dim=-1).sum().double(),
        Reduce.POS_TOKEN_MEAN: (mask_bt & (adv_bt > 0)).sum().double(),
        Reduce.NEG_TOKEN_MEAN: (mask_bt & (adv_bt < 0)).sum().double(),
        # Σ over micro-batches and ranks of tokens / num_tokens_global is 1: the engine's ratio is then a sum.
        Reduce.SUM: tokens / num_tokens.double().clamp(min=1),
    }


def _engine_metrics(metrics: MetricSet, weights: dict[Reduce, torch.Tensor]) -> Metrics:
    """``(weighted sum, weight)`` per metric, weighted by its own reduction; extrema left out."""
    out: Metrics = {}
    per_update = frozenset(name for name, m in metrics.items_with_reduction() if m.per_update)
    for name, metric in metrics.items_with_reduction():
        if metric.reduce in _EXTREMA:
            continue
        weight = weights[metric.reduce]
        value = torch.as_tensor(metric.value).double()
        weighted = value if metric.reduce is Reduce.SUM else value * weight
        out[name] = torch.stack((weighted, weight)).detach()
    return TaggedMetrics(out, per_update)


def _token_ratios(logp_bt: torch.Tensor, old_logp_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    log_ratio = (logp_bt.detach().float() - old_logp_bt.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio[mask_bt].exp()


def _get(batch: Mapping[str, torch.Tensor], key: str, device: torch.device) -> torch.Tensor:
    if key not in batch:
        hint = " (use add_global_normalisers on the step's micro-batches)" if key in NORMALISER_KEYS else ""
        raise KeyError(f"the policy loss hook needs micro-batch key {key!r}{hint}; got {sorted(batch)}")
    value = batch[key]
    return value.to(device) if isinstance(value, torch.Tensor) else torch.as_tensor(value, device=device)


def _resolve_dp_group(dp_group: GroupArg) -> dist.ProcessGroup | None:
    if not isinstance(dp_group, _MegatronGroup):  # MEGATRON_GROUP: resolved below
        return dp_group
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group()
