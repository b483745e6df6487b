"""On-policy distillation (OPD): teacher advantages and how they fuse with the RL advantage.

The teacher scores the student's own samples; its log-prob of each sampled token against the student's gives a
dense token-level advantage ``A_opd_t = sg[teacher_logp_t − student_logp_t]``, a one-sample estimate of minus
the reverse KL(student ‖ teacher) at that token (ALGORITHMS.md, "On-policy distillation (OPD) and SAF").

:data:`FusionConfig` says how ``A_opd`` meets the per-sequence RL advantage ``A_rl`` (``[batch]``, broadcast over
response tokens): ``rl``, ``opd``, ``fixed``, ``saf`` or ``mopd``; :func:`fuse_advantages` applies it.
Tensors are ``[batch, seq]``; the mask is 1 (True) on response tokens. No torch.distributed, no I/O: the trainer
computes the step's reverse KL, runs the :class:`~sapo_megatron.algo.saf.SAFSchedule` and passes the multiplier.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sapo_megatron.algo.aggregation import masked_mean
from sapo_megatron.algo.loss_registry import PolicyLoss
from sapo_megatron.algo.mismatch import LOG_RATIO_CLAMP, IcePop
from sapo_megatron.algo.saf import SAFSchedule, saf_compress, saf_keep_mask, saf_sparsify

FusionMetrics = dict[str, float]


# ---------------------------------------------------------------------------------------------- OPD advantages


def opd_advantages(
    teacher_logp_bt: torch.Tensor, student_logp_bt: torch.Tensor, mask_bt: torch.Tensor
) -> torch.Tensor:
    """``(teacher_logp − student_logp) · mask``: fp32 ``[batch, seq]``, detached (a target, not a parameter).

    ``student_logp`` is the log-prob the sample is trained against (the trainer's old-policy log-prob, or the
    engine's). Off the mask the result is exactly 0, whatever the inputs hold there (-inf or nan on padding).
    """
    mask = _check_same_shape(mask_bt, teacher_logp_bt=teacher_logp_bt, student_logp_bt=student_logp_bt)
    gap_bt = teacher_logp_bt.detach().float() - student_logp_bt.detach().float()
    adv_bt = torch.where(mask, gap_bt, 0.0)
    if not torch.isfinite(adv_bt).all():
        bad = int((mask & ~torch.isfinite(gap_bt)).sum())
        raise ValueError(
            f"opd_advantages: {bad} response token(s) have a non-finite teacher/student log-prob"
        )
    return adv_bt


def opd_reverse_kl(
    teacher_logp_bt: torch.Tensor, student_logp_bt: torch.Tensor, mask_bt: torch.Tensor
) -> float:
    """Mean of ``student_logp − teacher_logp`` over response tokens: the per-token sample estimate of
    KL(student ‖ teacher) on the student's own samples (slime's ``opd_reverse_kl``). 0 without response tokens."""
    return -float(masked_mean(opd_advantages(teacher_logp_bt, student_logp_bt, mask_bt), mask_bt))


def opd_k3(
    student_logp_bt: torch.Tensor, teacher_logp_bt: torch.Tensor, mask_bt: torch.Tensor
) -> torch.Tensor:
    """0-d mean over response tokens of verl's ``low_var_kl`` between the student and the teacher:
    ``clamp(exp(d) − d − 1, −10, 10)`` with ``d = clamp(teacher − student, −20, 20)``. SAF's authors load the
    teacher as verl's reference model with ``kl_loss_coef = 0``, so their ``actor/kl_loss`` – the warm-up's KL
    signal – is this quantity during the update; 0 without response tokens."""
    mask = _check_same_shape(mask_bt, student_logp_bt=student_logp_bt, teacher_logp_bt=teacher_logp_bt)
    d_bt = (teacher_logp_bt.detach().float() - student_logp_bt.detach().float()).clamp(-20.0, 20.0)
    k3_bt = (d_bt.exp() - d_bt - 1.0).clamp(-10.0, 10.0)
    return masked_mean(torch.where(mask, k3_bt, 0.0), mask)


def route_by_domain(logp_by_domain: Mapping[str, torch.Tensor], domains: Sequence[str]) -> torch.Tensor:
    """MOPD routing: row ``i`` of the result is row ``i`` of ``logp_by_domain[domains[i]]``.

    Each ``[batch, seq]`` entry holds the log-probs of the teacher serving that domain (only the rows of its own
    domain need be meaningful); one teacher per sample, no averaging (as NeMo-RL and MiMo-V2-Flash do).
    """
    if not logp_by_domain:
        raise ValueError("route_by_domain needs at least one domain's teacher log-probs")
    shapes = {tuple(t.shape) for t in logp_by_domain.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"teacher log-probs must all have one [batch, seq] shape, got {sorted(shapes)}")
    batch = next(iter(shapes))[0]
    if len(domains) != batch:
        raise ValueError(f"got {len(domains)} domains for a batch of {batch} rows")
    unknown = sorted(set(domains) - set(logp_by_domain))
    if unknown:
        raise ValueError(f"no teacher log-probs for domain(s) {unknown}; have {sorted(logp_by_domain)}")
    rows = [logp_by_domain[domain][i] for i, domain in enumerate(domains)]
    return torch.stack(rows)


def mopd_is_weight(
    old_logp_bt: torch.Tensor,
    rollout_logp_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
) -> torch.Tensor:
    """MOPD's masked importance weight, detached fp32 ``[batch, seq]``, 0 off the mask.

    ``w_t = r_t`` if ``eps_low <= r_t <= eps_high`` else 0, with ``r_t = π_train(y_t) / μ_engine(y_t) =
    exp(old_logp − rollout_logp)``: the training–inference correction of MiMo-V2-Flash's MOPD objective
    ``−(1/|y|) Σ_t w_t · Â_t · log π_θ(y_t)``. Equal to :class:`~sapo_megatron.algo.mismatch.IcePop`'s weight with
    ``low=eps_low, high=eps_high``, so the loss can apply it as its mismatch correction.
    """
    mask = _check_same_shape(mask_bt, old_logp_bt=old_logp_bt, rollout_logp_bt=rollout_logp_bt)
    delta_bt = (old_logp_bt.detach().float() - rollout_logp_bt.detach().float()).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    ratio_bt = delta_bt.exp()
    inside_bt = mask & (ratio_bt >= eps_low) & (ratio_bt <= eps_high)
    return torch.where(inside_bt, ratio_bt, 0.0)


# ---------------------------------------------------------------------------------------------- fusion configs


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RlFusion(_Settings):
    """RL advantage only (no distillation). A given ``A_opd`` is only measured (reverse-KL curves of RL runs)."""

    mode: Literal["rl"] = "rl"


class OpdFusion(_Settings):
    """OPD advantage only: ``A_t = A_opd_t`` (pure on-policy distillation, RL reward unused)."""

    mode: Literal["opd"] = "opd"


class FixedFusion(_Settings):
    """Fixed-ratio fusion ``A_t = A_rl + coef · A_opd_t`` (slime's ``--opd-kl-coef``; ``coef = 1`` is the 1:1
    baseline that SAF reports collapses entropy)."""

    mode: Literal["fixed"] = "fixed"
    coef: float = Field(1.0, gt=0, description="λ, the weight of the OPD advantage")


class SafSparsify(_Settings):
    keep: float = Field(0.2, gt=0, le=1, description="fraction of each sequence's response tokens kept")


class SafCompress(_Settings):
    c: float = Field(0.1, gt=0, description="bound of c·tanh(A_opd)")


class SafWarmup(_Settings):
    steps: int = Field(100, ge=1, description="W (opd_warmup_steps): scale = min(step / W, 1)")
    kl_drop: float = Field(
        0.2,
        ge=0,
        le=1,
        description="δ (kl_drop_delta): warm-up ends once (KL_0 − KL) / KL_0 >= δ; 0: no early stop",
    )


class SafAnneal(_Settings):
    steps: int = Field(
        200, ge=1, description="R (anneal_steps): coef reaches floor R steps after warm-up ends"
    )
    floor: float = Field(
        0.0, ge=0, lt=1, description="m (anneal_min), the final coef (1 would never anneal: use null)"
    )
    total_steps: int | None = Field(
        None,
        ge=1,
        description="S (anneal_total_steps): warm-up + anneal budget, R = max(1, S − warm-up end step); "
        "null: use steps",
    )


class SafFusion(_Settings):
    """SAF (arXiv:2607.29209): ``A_t = grpo_coef · A_rl + opd_coef · multiplier · compress(sparsify(A_opd))_t``.

    Each stage is a sub-section holding its own settings; ``null`` switches it off. ``multiplier = scale · coef``
    comes from :meth:`build_schedule` (None when warm-up and anneal are both off: multiplier 1). The defaults are
    the authors' selected hyper-parameters (docs/distillation.md has their keys).
    """

    mode: Literal["saf"] = "saf"
    grpo_coef: float = Field(1.0, ge=0, description="weight of the RL advantage (the authors' grpo_coef)")
    opd_coef: float = Field(
        1.0, gt=0, description="λ, the weight of the SAF-transformed OPD advantage (the authors' opd_coef)"
    )
    sparsify: SafSparsify | None = Field(default_factory=SafSparsify)
    compress: SafCompress | None = Field(default_factory=SafCompress)
    warmup: SafWarmup | None = Field(default_factory=SafWarmup)
    anneal: SafAnneal | None = Field(default_factory=SafAnneal)

    def build_schedule(self) -> SAFSchedule | None:
        """The per-step multiplier's schedule; None when warm-up and anneal are both off."""
        if self.warmup is None and self.anneal is None:
            return None
        return SAFSchedule(
            warmup_steps=None if self.warmup is None else self.warmup.steps,
            kl_drop=0.2 if self.warmup is None else self.warmup.kl_drop,  # unused without warm-up
            anneal_steps=None if self.anneal is None else self.anneal.steps,
            floor=0.0 if self.anneal is None else self.anneal.floor,
            anneal_total_steps=None if self.anneal is None else self.anneal.total_steps,
        )

    def transform(self, adv_opd_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
        """``compress(sparsify(A_opd))`` with the stages that are on (fp32, 0 off the mask)."""
        adv_bt = torch.where(mask_bt.bool(), adv_opd_bt.float(), 0.0)
        if self.sparsify is not None:
            adv_bt = saf_sparsify(adv_bt, mask_bt, keep=self.sparsify.keep)
        if self.compress is not None:
            adv_bt = saf_compress(adv_bt, c=self.compress.c)
        return adv_bt


class MopdFusion(_Settings):
    """Multi-teacher OPD (MiMo-V2-Flash, arXiv:2601.02780): ``A_t = A_opd_t(teacher of the row's domain) +
    alpha · A_rl``, trained with the masked importance weight :func:`mopd_is_weight` in ``[eps_low, eps_high]``.

    Build ``A_opd`` from :func:`route_by_domain`. ``alpha = 0`` is NeMo-RL's MOPD (teacher advantage only).
    The weight band defaults to the project's IcePop band; :meth:`correction` hands it to the loss.
    """

    mode: Literal["mopd"] = "mopd"
    alpha: float = Field(1.0, ge=0, description="weight of the outcome (RL) advantage")
    eps_low: float = Field(0.5, gt=0, description="smallest train/engine ratio that keeps its token")
    eps_high: float = Field(2.0, gt=0, description="largest train/engine ratio that keeps its token")

    @model_validator(mode="after")
    def _check_band(self) -> MopdFusion:
        if self.eps_low >= self.eps_high:
            raise ValueError(
                f"mopd needs eps_low < eps_high, got eps_low={self.eps_low}, eps_high={self.eps_high}"
            )
        return self

    def is_weight(
        self, old_logp_bt: torch.Tensor, rollout_logp_bt: torch.Tensor, mask_bt: torch.Tensor
    ) -> torch.Tensor:
        """:func:`mopd_is_weight` with this band."""
        return mopd_is_weight(
            old_logp_bt, rollout_logp_bt, mask_bt, eps_low=self.eps_low, eps_high=self.eps_high
        )

    def correction(self) -> IcePop:
        """The same weight as a loss mismatch correction (``PolicyLoss.compute(..., correction=...)``)."""
        return IcePop(low=self.eps_low, high=self.eps_high)


Fusion = RlFusion | OpdFusion | FixedFusion | SafFusion | MopdFusion
FusionConfig = Annotated[Fusion, Field(discriminator="mode")]
FUSION_MODES: tuple[str, ...] = ("rl", "opd", "fixed", "saf", "mopd")


def check_fusion_loss(fusion: Fusion, loss: PolicyLoss) -> None:
    """Refuse token-level advantages with a loss whose ratio is sequence-level (config validation calls this).

    Every mode but ``rl`` gives token-level advantages. Sequence-level GSPO (``name: gspo``) clips one ratio per
    sequence and needs one advantage per sequence; SAPO, GRPO and GSPO-token have a per-token ratio and carry them.
    """
    if fusion.mode != "rl" and loss.name in ("gspo", "gmpo"):
        raise ValueError(
            f"algorithm.fusion.mode={fusion.mode!r} gives token-level advantages, which "
            f"algorithm.loss.name={loss.name!r} "
            "cannot carry: its sequence-level ratio needs one advantage per sequence. Use algorithm.loss.name "
            "'gspo_token' (same sequence ratio, per-token gradient), 'sapo' or 'grpo', or algorithm.fusion.mode 'rl'"
        )


# ---------------------------------------------------------------------------------------------- fusion


def fuse_advantages(
    fusion: Fusion,
    adv_rl_b: torch.Tensor,
    adv_opd_bt: torch.Tensor | None,
    mask_bt: torch.Tensor,
    *,
    multiplier: float | None = None,
    domains: Sequence[str] | None = None,
) -> tuple[torch.Tensor, FusionMetrics]:
    """Token advantages ``[batch, seq]`` (fp32, detached, 0 off the mask) and metrics for one RL step.

    ``adv_rl_b``: ``[batch]`` per-sequence RL advantage, broadcast over response tokens. ``adv_opd_bt``: from
    :func:`opd_advantages` (for ``mopd`` with :func:`route_by_domain`); may be None only for ``rl``.
    ``multiplier``: the step's ``SAFSchedule.update(kl)``, required for ``saf`` with a schedule, refused otherwise.
    ``domains``: the rows' domains, for per-domain metrics; required for ``mopd``.

    Metrics (means over response tokens): ``adv/rl_abs_mean``, ``adv/fused_abs_mean``; given ``A_opd``:
    ``opd/reverse_kl`` (``= −mean A_opd``), ``opd/adv_abs_mean``; for ``saf``: ``opd/adv_abs_mean_after_saf``
    (of the term added, ``opd_coef · multiplier · compress(sparsify(A_opd))``) and ``saf/kept_frac``; with
    ``domains``: ``opd/reverse_kl/<domain>`` and ``opd/adv_abs_mean/<domain>``.
    """
    mask = mask_bt.bool()
    adv_rl_bt = _broadcast_rl(adv_rl_b, mask)
    adv_opd = _check_opd(fusion, adv_opd_bt, mask)
    _check_multiplier(fusion, multiplier)
    if fusion.mode == "mopd" and domains is None:
        raise ValueError("fusion mode 'mopd' needs the rows' domains (per-domain metrics)")

    metrics: FusionMetrics = {"adv/rl_abs_mean": _abs_mean(adv_rl_bt, mask)}
    if adv_opd is not None:
        metrics.update(_opd_metrics(adv_opd, mask, domains))

    if fusion.mode == "rl" or adv_opd is None:  # _check_opd: None only for rl
        adv_bt = adv_rl_bt
    elif fusion.mode == "opd":
        adv_bt = adv_opd
    elif fusion.mode == "fixed":
        adv_bt = adv_rl_bt + fusion.coef * adv_opd
    elif fusion.mode == "saf":
        scheduled = 1.0 if multiplier is None else multiplier
        term_bt = fusion.opd_coef * scheduled * fusion.transform(adv_opd, mask)
        metrics["opd/adv_abs_mean_after_saf"] = _abs_mean(term_bt, mask)
        metrics["saf/kept_frac"] = _kept_frac(fusion, adv_opd, mask)
        adv_bt = fusion.grpo_coef * adv_rl_bt + term_bt
    else:
        adv_bt = adv_opd + fusion.alpha * adv_rl_bt
    adv_bt = torch.where(mask, adv_bt, 0.0)
    metrics["adv/fused_abs_mean"] = _abs_mean(adv_bt, mask)
    return adv_bt, metrics


def _broadcast_rl(adv_rl_b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.dim() != 2 or adv_rl_b.shape != mask.shape[:1]:
        raise ValueError(
            f"adv_rl_b must be [batch] for mask_bt [batch, seq]: got {tuple(adv_rl_b.shape)} and {tuple(mask.shape)}"
        )
    return torch.where(mask, adv_rl_b.detach().float()[:, None], 0.0)


def _check_opd(fusion: Fusion, adv_opd_bt: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    if adv_opd_bt is None:
        if fusion.mode != "rl":
            raise ValueError(f"fusion mode {fusion.mode!r} needs adv_opd_bt (the teacher advantages)")
        return None
    _check_same_shape(mask, adv_opd_bt=adv_opd_bt)
    return torch.where(mask, adv_opd_bt.detach().float(), 0.0)


def _check_multiplier(fusion: Fusion, multiplier: float | None) -> None:
    scheduled = isinstance(fusion, SafFusion) and (fusion.warmup is not None or fusion.anneal is not None)
    if scheduled and multiplier is None:
        raise ValueError(
            "fusion mode 'saf' with warmup/anneal needs the step's multiplier (SAFSchedule.update)"
        )
    if not scheduled and multiplier is not None:
        raise ValueError(
            f"multiplier only applies to fusion mode 'saf' with warmup or anneal on; got it for {fusion!r}"
        )


def _opd_metrics(adv_opd: torch.Tensor, mask: torch.Tensor, domains: Sequence[str] | None) -> FusionMetrics:
    metrics = {
        "opd/reverse_kl": -float(masked_mean(adv_opd, mask)),
        "opd/adv_abs_mean": _abs_mean(adv_opd, mask),
    }
    if domains is None:
        return metrics
    if len(domains) != mask.shape[0]:
        raise ValueError(f"got {len(domains)} domains for a batch of {mask.shape[0]} rows")
    for domain in sorted(set(domains)):
        rows = torch.tensor([d == domain for d in domains], device=mask.device)[:, None]
        metrics[f"opd/reverse_kl/{domain}"] = -float(masked_mean(adv_opd, mask & rows))
        metrics[f"opd/adv_abs_mean/{domain}"] = _abs_mean(adv_opd, mask & rows)
    return metrics


def _kept_frac(fusion: SafFusion, adv_opd: torch.Tensor, mask: torch.Tensor) -> float:
    if fusion.sparsify is None:
        return 1.0 if mask.any() else 0.0
    kept_bt = saf_keep_mask(adv_opd, mask, keep=fusion.sparsify.keep)
    return float(kept_bt.sum() / mask.sum().clamp(min=1))


def _abs_mean(x_bt: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(x_bt.abs(), mask))


def _check_same_shape(mask_bt: torch.Tensor, **tensors: torch.Tensor) -> torch.Tensor:
    if mask_bt.dim() != 2:
        raise ValueError(f"mask_bt must be [batch, seq], got shape {tuple(mask_bt.shape)}")
    for name, tensor in tensors.items():
        if tensor.shape != mask_bt.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(mask_bt.shape)} like mask_bt"
            )
    return mask_bt.bool()
