"""SAF, Stable Advantage Fusion (arXiv:2607.29209): the four stages applied to the OPD advantage only.

Fusing RL advantages with on-policy distillation at a fixed ratio collapses entropy: the token-level OPD advantage
can dwarf the bounded RL advantage (magnitude mismatch), and it pulls the student to the teacher all through
training (temporal mismatch). SAF answers the first with :func:`saf_sparsify` and :func:`saf_compress`, the second
with the warm-up and anneal of :class:`SAFSchedule`::

    A_t = A_rl + λ · scale · coef · compress(sparsify(A_opd))_t

Tensors are ``[batch, seq]``; the mask is 1 (True) on response tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# ceil(keep · n) in float arithmetic: 0.7 · 10 is 7.000000000000001, whose ceil would keep 8 tokens, not 7.
_CEIL_SLACK = 1e-9


def saf_sparsify(adv_bt: torch.Tensor, mask_bt: torch.Tensor, keep: float = 0.2) -> torch.Tensor:
    """Per sequence, keep the ``ceil(keep · n)`` response tokens with the largest ``|adv|`` and zero the rest.

    ``n`` is that sequence's number of response tokens; at least one token is kept when ``n > 0`` and a row
    without response tokens stays all zero, as does everything off the mask. ``keep`` in ``(0, 1]``; 1 keeps
    every response token. Ties: see :func:`saf_keep_mask`. Returns fp32 ``[batch, seq]``.
    """
    kept_bt = saf_keep_mask(adv_bt, mask_bt, keep)
    return torch.where(kept_bt, adv_bt.float(), 0.0)


def saf_keep_mask(adv_bt: torch.Tensor, mask_bt: torch.Tensor, keep: float = 0.2) -> torch.Tensor:
    """Bool ``[batch, seq]``: the tokens :func:`saf_sparsify` keeps.

    Ties are broken by position: among equal ``|adv|`` the earlier token is kept. So exactly
    ``min(n, max(1, ceil(keep · n)))`` tokens survive in every row with ``n > 0``, where ALGORITHMS.md's "at or
    above the (1 − k) quantile" wording would keep every token tied at the threshold. Raises on non-finite values
    on the mask.
    """
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"saf sparsify needs 0 < keep <= 1, got keep={keep}")
    mask = _check_pair(adv_bt, mask_bt)
    adv = torch.where(mask, adv_bt.float(), 0.0)
    if not torch.isfinite(adv).all():
        raise ValueError("saf_sparsify: adv_bt has non-finite values on response tokens")
    n_b = mask.sum(-1)
    k_b = torch.ceil(keep * n_b.double() - _CEIL_SLACK).long().clamp(min=1)
    # Off-mask tokens sort last (|adv| >= 0 > -1); a stable descending sort puts the earlier of equal keys first.
    key_bt = torch.where(mask, adv.abs(), -1.0)
    order_bt = torch.sort(key_bt, dim=-1, descending=True, stable=True).indices
    rank_bt = torch.empty_like(order_bt)
    positions = torch.arange(adv.shape[-1], device=adv.device).expand_as(order_bt)
    rank_bt.scatter_(-1, order_bt, positions)
    return mask & (rank_bt < k_b[:, None])


def saf_compress(adv_bt: torch.Tensor, c: float = 0.1) -> torch.Tensor:
    """``c · tanh(adv)`` (fp32, same shape): bounded by ``c`` in absolute value, about ``c · adv`` near 0."""
    if not c > 0.0:
        raise ValueError(f"saf compress needs c > 0, got c={c}")
    return c * torch.tanh(adv_bt.float())


class SAFSchedule:
    """SAF's warm-up and anneal: the per-step multiplier ``scale · coef`` of the OPD term.

    Call :meth:`update` once per RL step (the first call is step 1) with that step's mean student–teacher reverse
    KL. With ``s`` the step where warm-up ends:

    - ``scale = min(step / warmup_steps, 1)`` until warm-up ends at the first step where ``step >= warmup_steps``
      or ``kl <= (1 − kl_drop) · kl_first``; from then on the scale stays at its value at ``s``.
      The early stop needs ``kl_first > 0``: a first KL at or below 0 (teacher and student already agree, or a
      negative sample estimate) has nothing to drop from, so warm-up then runs to ``warmup_steps``.
    - ``coef = 1`` up to ``s``, then ``floor + (1 − floor) · max(0, 1 − (step − s) / anneal_steps)``.

    ``warmup_steps=None`` switches warm-up off: scale 1 and warm-up counts as ended at step 0, so the anneal
    reaches ``floor`` at step ``anneal_steps``. ``anneal_steps=None`` switches the anneal off (coef 1).
    """

    def __init__(
        self,
        warmup_steps: int | None = 100,
        kl_drop: float = 0.2,
        anneal_steps: int | None = 200,
        floor: float = 0.0,
    ) -> None:
        _check_steps("warmup_steps", warmup_steps)
        _check_steps("anneal_steps", anneal_steps)
        if not 0.0 < kl_drop <= 1.0:
            raise ValueError(f"SAFSchedule needs 0 < kl_drop <= 1 (relative KL drop), got kl_drop={kl_drop}")
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"SAFSchedule needs 0 <= floor <= 1 (the final coef), got floor={floor}")
        self._settings = {
            "warmup_steps": warmup_steps,
            "kl_drop": float(kl_drop),
            "anneal_steps": anneal_steps,
            "floor": float(floor),
        }
        self._step = 0
        self._kl_first: float | None = None
        self._warmup_end_step: int | None = 0 if warmup_steps is None else None
        self._scale: float | None = None
        self._coef: float | None = None

    def update(self, kl: float) -> float:
        """Advance one RL step with its mean reverse KL; returns that step's multiplier ``scale · coef``."""
        kl = float(kl)
        if not math.isfinite(kl):
            raise ValueError(f"SAFSchedule.update needs a finite reverse KL, got {kl}")
        self._step += 1
        if self._kl_first is None:
            self._kl_first = kl
        self._scale = self._next_scale(kl)
        self._coef = self._next_coef()
        return self._scale * self._coef

    def _next_scale(self, kl: float) -> float:
        warmup_steps = self._settings["warmup_steps"]
        if warmup_steps is None:
            return 1.0
        if self.warmup_ended:
            return self._scale  # frozen at its value at the end of warm-up
        scale = min(self._step / warmup_steps, 1.0)
        kl_first = self._kl_first
        dropped = kl_first > 0 and kl <= (1.0 - self._settings["kl_drop"]) * kl_first
        if self._step >= warmup_steps or dropped:
            self._warmup_end_step = self._step
        return scale

    def _next_coef(self) -> float:
        anneal_steps, floor = self._settings["anneal_steps"], self._settings["floor"]
        if anneal_steps is None or not self.warmup_ended or self._step <= self._warmup_end_step:
            return 1.0
        progress = (self._step - self._warmup_end_step) / anneal_steps
        return floor + (1.0 - floor) * max(0.0, 1.0 - progress)

    @property
    def step(self) -> int:
        """RL steps seen so far (0 before the first :meth:`update`)."""
        return self._step

    @property
    def scale(self) -> float:
        """The last step's warm-up scale."""
        return self._last("scale", self._scale)

    @property
    def coef(self) -> float:
        """The last step's anneal coefficient."""
        return self._last("coef", self._coef)

    @property
    def multiplier(self) -> float:
        """The last step's ``scale · coef`` (what :meth:`update` returned)."""
        return self.scale * self.coef

    @property
    def warmup_ended(self) -> bool:
        return self._warmup_end_step is not None

    @property
    def warmup_end_step(self) -> int | None:
        """The step ``s`` where warm-up ended (0 when warm-up is off), None while it runs."""
        return self._warmup_end_step

    def metrics(self) -> dict[str, float]:
        """``saf/scale``, ``saf/coef``, ``saf/multiplier`` of the last step."""
        return {"saf/scale": self.scale, "saf/coef": self.coef, "saf/multiplier": self.multiplier}

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (JSON-safe, exact floats) to resume the schedule with :meth:`load_state_dict`."""
        return {
            "settings": dict(self._settings),
            "step": self._step,
            "kl_first": self._kl_first,
            "warmup_end_step": self._warmup_end_step,
            "scale": self._scale,
            "coef": self._coef,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved schedule; its settings must equal this one's (a changed schedule cannot resume exactly)."""
        saved = state["settings"]
        changed = sorted(k for k in self._settings if saved.get(k) != self._settings[k])
        if changed:
            diffs = ", ".join(f"{k}: saved {saved.get(k)!r}, now {self._settings[k]!r}" for k in changed)
            raise ValueError(
                f"SAF schedule settings differ from the checkpoint's ({diffs}); resume with the saved ones"
            )
        self._step = int(state["step"])
        self._kl_first = state["kl_first"]
        self._warmup_end_step = state["warmup_end_step"]
        self._scale = state["scale"]
        self._coef = state["coef"]

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self._settings.items())
        return f"SAFSchedule({settings}; step={self._step}, warmup_end_step={self._warmup_end_step})"

    def _last(self, name: str, value: float | None) -> float:
        if value is None:
            raise RuntimeError(f"SAFSchedule.{name} is read before the first update()")
        return value


def _check_steps(name: str, steps: int | None) -> None:
    if steps is None:
        return
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"SAFSchedule needs {name} to be an integer >= 1 or None (off), got {steps!r}")


def _check_pair(adv_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    if adv_bt.dim() != 2 or adv_bt.shape != mask_bt.shape:
        raise ValueError(
            f"adv_bt {tuple(adv_bt.shape)} and mask_bt {tuple(mask_bt.shape)} must both be [batch, seq]"
        )
    return mask_bt.bool()
