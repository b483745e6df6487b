"""SAF, Stable Advantage Fusion (arXiv:2607.29209): the four stages applied to the OPD advantage only, as the
authors' code computes them (repository ``kissshhot/SAF-OPD``, ``verl/verl/trainer/ppo/ray_trainer.py``:
``apply_topk_sparse_filter``, ``apply_tanh_scaling``, ``_apply_token_kl_regularizer``).

Fusing RL advantages with on-policy distillation at a fixed ratio collapses entropy: the token-level OPD advantage
can dwarf the bounded RL advantage (magnitude mismatch), and it pulls the student to the teacher all through
training (temporal mismatch). SAF answers the first with :func:`saf_sparsify` and :func:`saf_compress`, the second
with the warm-up and anneal of :class:`SAFSchedule`::

    A_t = grpo_coef · A_rl + opd_coef · scale · coef · compress(sparsify(A_opd))_t

Tensors are ``[batch, seq]``; the mask is 1 (True) on response tokens.
"""

from __future__ import annotations

import math
from typing import Any, TypedDict

import torch


def saf_sparsify(adv_bt: torch.Tensor, mask_bt: torch.Tensor, keep: float = 0.2) -> torch.Tensor:
    """Per sequence, zero every response token whose ``|adv|`` is below ``torch.quantile(|adv| over that
    sequence's response tokens, 1 − keep)`` (linear interpolation); see :func:`saf_keep_mask`.
    Returns fp32 ``[batch, seq]``, 0 off the mask."""
    kept_bt = saf_keep_mask(adv_bt, mask_bt, keep)
    return torch.where(kept_bt, adv_bt.float(), 0.0)


def saf_keep_mask(adv_bt: torch.Tensor, mask_bt: torch.Tensor, keep: float = 0.2) -> torch.Tensor:
    """Bool ``[batch, seq]``: the tokens :func:`saf_sparsify` keeps, ``mask & (|adv| >= τ_row)``.

    ``τ_row`` is the ``1 − keep`` quantile of the row's ``|adv|`` on the mask, as ``torch.quantile`` computes it
    (the authors' rule): every token tied at the threshold is kept, so a row may keep more than ``keep · n``
    tokens (all of them when all are equal); ``keep = 1`` keeps the whole mask. A row without response tokens
    keeps none. ``keep`` in ``(0, 1]``; raises on non-finite values on the mask.
    """
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"saf sparsify needs 0 < keep <= 1, got keep={keep}")
    mask = _check_pair(adv_bt, mask_bt)
    abs_bt = torch.where(mask, adv_bt.float(), 0.0).abs()
    if not torch.isfinite(abs_bt).all():
        raise ValueError("saf_sparsify: adv_bt has non-finite values on response tokens")
    if keep == 1.0:
        return mask.clone()
    # nanquantile over the masked values of each row = torch.quantile of that row's response tokens.
    tau_b = torch.nanquantile(torch.where(mask, abs_bt, float("nan")), 1.0 - keep, dim=-1)
    return mask & (abs_bt >= tau_b[:, None])


def saf_compress(adv_bt: torch.Tensor, c: float = 0.1) -> torch.Tensor:
    """``c · tanh(adv)`` (fp32, same shape): bounded by ``c`` in absolute value, about ``c · adv`` near 0."""
    if not c > 0.0:
        raise ValueError(f"saf compress needs c > 0, got c={c}")
    return c * torch.tanh(adv_bt.float())


class _ScheduleSettings(TypedDict):
    warmup_steps: int | None
    kl_drop: float
    anneal_steps: int | None
    floor: float
    anneal_total_steps: int | None


class SAFSchedule:
    """SAF's warm-up and anneal: the per-step multiplier ``scale · coef`` of the OPD term (the authors' Stage 3
    and Stage 4 of ``_apply_token_kl_regularizer``).

    Call :meth:`update` once per RL step (the first call is global step 1) with the KL signal available at that
    step: the previous update's k3 (``low_var_kl``) between the student and the teacher, None at the first step.

    Warm-up (``warmup_steps`` W; None = off, scale 1): ``scale = min(step / W, 1)``. ``KL_0`` is the first KL
    seen. Warm-up ends at the first step where ``step >= W``, or where ``kl_drop`` δ > 0, ``KL_0 > 0``, this
    step has a KL and ``(KL_0 − KL) / KL_0 >= δ`` (δ = 0: no early stop); the scale is then frozen at its value
    at that step ``s``.

    Anneal (``anneal_steps`` R; None = off, coef 1): activates on the first step that warm-up is not in
    progress (step ``s``; step 1 without warm-up) with its own counter t = 0 there, +1 each step after:
    ``coef = floor + (1 − floor) · max(0, 1 − t / R)``; with ``anneal_total_steps`` S, R = max(1, S − s)
    (s = 0 without warm-up).
    """

    def __init__(
        self,
        warmup_steps: int | None = 100,
        kl_drop: float = 0.2,
        anneal_steps: int | None = 200,
        floor: float = 0.0,
        anneal_total_steps: int | None = None,
    ) -> None:
        _check_steps("warmup_steps", warmup_steps)
        _check_steps("anneal_steps", anneal_steps)
        _check_steps("anneal_total_steps", anneal_total_steps)
        if not 0.0 <= kl_drop <= 1.0:
            raise ValueError(
                f"SAFSchedule needs 0 <= kl_drop <= 1 (relative KL drop; 0: no early stop), got kl_drop={kl_drop}"
            )
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"SAFSchedule needs 0 <= floor <= 1 (the final coef), got floor={floor}")
        self._settings: _ScheduleSettings = {
            "warmup_steps": warmup_steps,
            "kl_drop": float(kl_drop),
            "anneal_steps": anneal_steps,
            "floor": float(floor),
            "anneal_total_steps": anneal_total_steps,
        }
        self._step = 0
        self._kl_first: float | None = None
        self._warmup_end_step: int | None = 0 if warmup_steps is None else None
        self._anneal_t: int | None = None  # None until the anneal activates
        self._anneal_span: int | None = None  # R in effect once active
        self._scale: float | None = None
        self._coef: float | None = None

    def update(self, kl: float | None) -> float:
        """Advance one RL step with its KL signal (None: none yet); returns that step's ``scale · coef``."""
        if kl is not None:
            kl = float(kl)
            if not math.isfinite(kl):
                raise ValueError(f"SAFSchedule.update needs a finite KL (or None), got {kl}")
        self._step += 1
        self._scale = self._next_scale(kl)
        self._coef = self._next_coef()
        return self._scale * self._coef

    def _next_scale(self, kl: float | None) -> float:
        warmup_steps = self._settings["warmup_steps"]
        if warmup_steps is None:
            return 1.0
        if self.warmup_ended:
            return self._last("scale", self._scale)  # frozen at its value at the end of warm-up
        if self._kl_first is None and kl is not None:
            self._kl_first = kl
        delta, kl_first = self._settings["kl_drop"], self._kl_first
        dropped = (
            delta > 0.0
            and kl_first is not None
            and kl_first > 0.0
            and kl is not None
            and (kl_first - kl) / kl_first >= delta
        )
        if self._step >= warmup_steps or dropped:
            self._warmup_end_step = self._step
        return min(self._step / warmup_steps, 1.0)

    def _next_coef(self) -> float:
        anneal_steps, floor = self._settings["anneal_steps"], self._settings["floor"]
        end = self._warmup_end_step
        if anneal_steps is None or end is None:  # off, or warm-up not ended
            return 1.0
        if self._anneal_t is None:
            self._anneal_t = 0
            total = self._settings["anneal_total_steps"]
            self._anneal_span = anneal_steps if total is None else max(1, total - end)
        else:
            self._anneal_t += 1
        span = self._anneal_span
        assert span is not None  # set together with _anneal_t
        return floor + (1.0 - floor) * max(0.0, 1.0 - self._anneal_t / span)

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

    @property
    def kl_first(self) -> float | None:
        """``KL_0``: the first KL signal the warm-up saw (None before one, or without warm-up)."""
        return self._kl_first

    def metrics(self) -> dict[str, float]:
        """``saf/scale``, ``saf/coef``, ``saf/multiplier`` of the last step (and ``saf/anneal_t`` once active)."""
        out = {"saf/scale": self.scale, "saf/coef": self.coef, "saf/multiplier": self.multiplier}
        if self._anneal_t is not None:
            out["saf/anneal_t"] = float(self._anneal_t)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (JSON-safe, exact floats) to resume the schedule with :meth:`load_state_dict`."""
        return {
            "settings": dict(self._settings),
            "step": self._step,
            "kl_first": self._kl_first,
            "warmup_end_step": self._warmup_end_step,
            "anneal_t": self._anneal_t,
            "anneal_span": self._anneal_span,
            "scale": self._scale,
            "coef": self._coef,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved schedule; its settings must equal this one's (a changed schedule cannot resume exactly)."""
        saved, mine = state["settings"], dict(self._settings)
        changed = sorted(k for k in mine if saved.get(k) != mine[k])
        if changed:
            diffs = ", ".join(f"{k}: saved {saved.get(k)!r}, now {mine[k]!r}" for k in changed)
            raise ValueError(
                f"SAF schedule settings differ from the checkpoint's ({diffs}); resume with the saved ones"
            )
        self._step = int(state["step"])
        self._kl_first = state["kl_first"]
        self._warmup_end_step = state["warmup_end_step"]
        self._anneal_t = state.get("anneal_t")
        self._anneal_span = state.get("anneal_span")
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
