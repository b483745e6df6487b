"""The RL step's distillation, on every rank: the teacher-fusion pass (after the old-log-prob pass) turns each
micro-batch's teacher log-probs into token-level advantages ``[b, s]`` fused with the RL advantage
(``algorithm.fusion``) and returns them as a :class:`FusedAdvantages` part; it steps the SAF schedule with the previous update's student–teacher k3 (:meth:`DistillStep.observe`), and report the metrics.

Where the numbers live: ``old_logp`` (the default student log-prob) exists only on the last pipeline stage, where
the loss runs, so the fusion happens there; other stages keep their ``[b]`` advantages, which nothing reads. The
step's reverse KL and every metric are sums over the micro-batches of all ranks, all-reduced over the whole world
(ranks without the loss add zeros; the tensor-parallel copies of a last-stage micro-batch add the same share to the
sum and to the count, which leaves the mean exact), so every rank steps the SAF schedule with the same value and
checkpoints the same state.

Metrics (means over the response tokens of the step): ``opd/reverse_kl`` (mean student − teacher log-prob gap),
``opd/adv_abs_mean`` (|A_opd| before SAF), ``opd/adv_abs_mean_after_saf`` (the term SAF adds), ``saf/kept_frac``,
``saf/scale``, ``saf/coef``, ``saf/multiplier``, ``adv/rl_abs_mean``, ``adv/fused_abs_mean``, and with several
prompt domains ``opd/reverse_kl/<domain>`` and ``opd/adv_abs_mean/<domain>``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sapo_megatron.algo import MismatchCorrection, SafFusion, fuse_advantages, opd_advantages
from sapo_megatron.distill.config import safe_metric_name
from sapo_megatron.model.batching import DOMAIN_IDS, TEACHER_LOGP, UNIT_TEMPERATURE_LOGP
from sapo_megatron.model.packing import SequenceView
from sapo_megatron.model.step_batch import MicroBatch, StepBatch, set_per_micro_batch

NO_DOMAIN = "none"
STUDENT_KEYS = {"trainer": "old_logp", "engine": "rollout_logp"}


@dataclass(frozen=True)
class FusedAdvantages:
    """The teacher-fusion pass's part: per micro-batch of the step, the fused token advantages ``[b, s]`` (None:
    the micro-batch keeps its advantages – off the last stage, or under ``rl``, which only measures), and the
    step's distillation metrics."""

    advantages: list[torch.Tensor | None] | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)

    def apply(self, batch: StepBatch) -> None:
        set_per_micro_batch(batch, "advantages", self.advantages)


class DistillStep:
    """Call :meth:`fuse` once per RL step, after the old-log-prob pass, on every rank; checkpoint
    :meth:`state_dict`. A no-op for runs without teachers."""

    def __init__(self, cfg, domains: Sequence[str] = ()) -> None:
        self.enabled = bool(cfg.teachers)
        self.fusion = cfg.algorithm.fusion
        self.student_key = STUDENT_KEYS[cfg.algorithm.opd_student_logp]
        if self.student_key == "old_logp" and cfg.rollout.temperature != 1.0:
            self.student_key = UNIT_TEMPERATURE_LOGP  # teachers score at temperature 1: so does the student
        self._kl_signal: float | None = None  # the last update's k3 student–teacher (SAF's warm-up signal)
        self.domain_names = list(domains)  # a row's domain_id indexes this list
        self.domains = [safe_metric_name(d) for d in domains]  # the same, as metric-name parts
        self.schedule = self.fusion.build_schedule() if isinstance(self.fusion, SafFusion) else None
        self.per_domain = self.fusion.mode == "mopd" or len(self.domains) > 1
        self._keys = self._metric_keys()

    def correction(self, configured: MismatchCorrection) -> MismatchCorrection:
        """The loss's mismatch correction: MOPD's masked importance weight under ``mopd`` (the config refuses
        another correction with it), else the configured one."""
        return self.fusion.correction() if self.fusion.mode == "mopd" else configured

    @property
    def unit_temperature_logp(self) -> bool:
        """Does the old-policy pass owe the student's log-prob at temperature 1 (``old_logp_t1``)?"""
        return self.enabled and self.student_key == UNIT_TEMPERATURE_LOGP

    def fuse(self, batch: StepBatch) -> FusedAdvantages:
        """The fused token advantages of each last-stage micro-batch (not under ``rl``, which only measures) and
        the step's metrics (identical on every rank)."""
        if not self.enabled:
            return FusedAdvantages()
        micro = batch.micro_batches()
        local = [b for b in micro if b.old_logp is not None]
        adv_opd = [self._adv_opd(b) for b in local]
        gap = [self._reverse_kl_sums(b, adv) for b, adv in zip(local, adv_opd)]
        kl_sum, tokens = _all_reduce(torch.tensor(gap, dtype=torch.float64).reshape(-1, 2).sum(0)).tolist()
        kl = kl_sum / max(tokens, 1.0)
        # SAF's authors step the schedule with the previous update's actor/kl_loss (None at the first step).
        multiplier = self.schedule.update(self._kl_signal) if self.schedule is not None else None
        sums = torch.zeros(len(self._keys), 2, dtype=torch.float64)
        fused: dict[int, torch.Tensor] = {}
        for b, adv in zip(local, adv_opd):
            fused_adv, batch_sums = self._fuse_batch(b, adv, multiplier)
            sums += batch_sums
            if fused_adv is not None:
                fused[id(b)] = fused_adv
        sums = _all_reduce(sums)
        metrics = {
            key: float(total / weight)
            for key, (total, weight) in zip(self._keys, sums.tolist())
            if weight > 0
        }
        metrics["opd/reverse_kl"] = kl
        if self.schedule is not None:
            metrics.update(self.schedule.metrics())
            if self._kl_signal is not None:
                metrics["saf/kl_signal"] = self._kl_signal
        return FusedAdvantages([fused.get(id(b)) for b in micro], metrics)

    def observe(self, train_metrics: dict[str, float]) -> None:
        """After the step's updates: keep their ``opd/student_teacher_k3`` (the loss hook's token mean of verl's
        ``low_var_kl`` between the student during the update and the teacher) for the next step's schedule."""
        if self.enabled and "opd/student_teacher_k3" in train_metrics:
            self._kl_signal = float(train_metrics["opd/student_teacher_k3"])

    def _adv_opd(self, batch: MicroBatch) -> torch.Tensor:
        if TEACHER_LOGP not in batch:
            raise KeyError("distillation needs teacher_logp in every micro-batch (the teachers scored none)")
        mask = batch["loss_mask"].bool()
        return opd_advantages(
            batch[TEACHER_LOGP].to(mask.device), batch[self.student_key].to(mask.device), mask
        )

    @staticmethod
    def _reverse_kl_sums(batch: MicroBatch, adv_opd: torch.Tensor) -> tuple[float, float]:
        mask = batch["loss_mask"].bool()
        return -float(adv_opd[mask].double().sum()), float(mask.sum())

    def _fuse_batch(
        self, batch: MicroBatch, adv_opd: torch.Tensor, multiplier: float | None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Fuse one micro-batch: its fused advantages in the batch's layout (None under ``rl``) and its ``(weighted
        sum, weight)`` per metric key. Packed micro-batches are fused on their per-sequence view and the token-level
        advantages laid back out packed."""
        view = SequenceView(batch)
        mask = view(batch["loss_mask"]).bool()
        names = self._row_domains(batch, rows=mask.shape[0])
        advantages = batch["advantages"].to(mask.device)
        advantages = view.per_sequence(advantages) if advantages.dim() == 1 else view(advantages)
        adv_bt, metrics = fuse_advantages(
            self.fusion,
            advantages,
            view(adv_opd),
            mask,
            multiplier=multiplier,
            domains=names if self.per_domain else None,
        )
        fused = view.to_batch(adv_bt, batch["loss_mask"]) if self.fusion.mode != "rl" else None
        tokens = float(mask.sum())
        weights = {NO_DOMAIN: tokens}
        for domain in set(names):
            rows = torch.tensor([n == domain for n in names], device=mask.device)[:, None]
            weights[domain] = float((mask & rows).sum())
        sums = torch.zeros(len(self._keys), 2, dtype=torch.float64)
        for index, key in enumerate(self._keys):
            if key not in metrics:
                continue
            weight = weights[self._key_domain(key)]
            sums[index] = torch.tensor([metrics[key] * weight, weight], dtype=torch.float64)
        return fused, sums

    def _row_domains(self, batch: MicroBatch, rows: int) -> list[str]:
        """The domain name of each of the ``rows`` sequences (an empty packed micro-batch's one row: none)."""
        ids = batch[DOMAIN_IDS].tolist() if DOMAIN_IDS in batch else []
        ids = ids if len(ids) == rows else [-1] * rows
        return [self.domains[i] if 0 <= i < len(self.domains) else NO_DOMAIN for i in ids]

    def _metric_keys(self) -> list[str]:
        """One fixed list on every rank (the all-reduce needs equal shapes), in the names fuse_advantages uses."""
        keys = ["adv/rl_abs_mean", "adv/fused_abs_mean", "opd/adv_abs_mean"]
        if self.fusion.mode == "saf":
            keys += ["opd/adv_abs_mean_after_saf", "saf/kept_frac"]
        if self.per_domain:
            for domain in [*self.domains, NO_DOMAIN]:
                keys += [f"opd/reverse_kl/{domain}", f"opd/adv_abs_mean/{domain}"]
        return keys

    def _key_domain(self, key: str) -> str:
        parts = key.split("/")
        return parts[2] if len(parts) == 3 else NO_DOMAIN

    def state_dict(self) -> dict[str, Any]:
        """The SAF schedule's state and its pending KL signal (empty without a schedule): plain values for the
        checkpoint's loop state."""
        if self.schedule is None:
            return {}
        return {"saf_schedule": self.schedule.state_dict(), "kl_signal": self._kl_signal}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.schedule is not None and state.get("saf_schedule"):
            self.schedule.load_state_dict(state["saf_schedule"])
            self._kl_signal = state.get("kl_signal")


def _all_reduce(values: torch.Tensor) -> torch.Tensor:
    """Sum over every rank (fp64); identity on a single process. NCCL needs the tensor on the GPU."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    reduced = values.to(device)
    dist.all_reduce(reduced)
    return reduced.cpu()
