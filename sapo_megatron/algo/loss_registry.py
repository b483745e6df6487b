"""Every policy loss by its config ``name`` (one discriminated union), and the builders that validate them.

SAPO, GRPO/DAPO and GSPO live in ``losses.py``; the baselines CISPO, GMPO, DPPO and M2PO in
``losses_baselines.py``. A new loss is a ``_PolicyLossBase`` subclass added to :data:`PolicyLoss` and
:data:`POLICY_LOSSES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import torch
from pydantic import Field, TypeAdapter

from sapo_megatron.algo.losses import GrpoLoss, GspoLoss, Metrics, SapoLoss, _PolicyLossBase
from sapo_megatron.algo.losses_baselines import CispoLoss, DppoLoss, GmpoLoss, M2poLoss
from sapo_megatron.algo.mismatch import MismatchCorrectionConfig

PolicyLoss = SapoLoss | GrpoLoss | GspoLoss | CispoLoss | GmpoLoss | DppoLoss | M2poLoss
PolicyLossConfig = Annotated[PolicyLoss, Field(discriminator="name")]
POLICY_LOSSES: dict[str, type[_PolicyLossBase]] = {
    "sapo": SapoLoss,
    "grpo": GrpoLoss,
    "gspo": GspoLoss,
    "gspo_token": GspoLoss,
    "cispo": CispoLoss,
    "gmpo": GmpoLoss,
    "dppo_tv": DppoLoss,
    "dppo_kl": DppoLoss,
    "m2po": M2poLoss,
}
COMPUTE_KWARGS = (
    "rollout_logp_bt",
    "ref_logp_bt",
    "entropy_bt",
    "correction",
    "num_sequences",
    "num_tokens",
    "is_weight_mean",
)


def build_policy_loss(config: PolicyLoss | Mapping[str, Any]) -> PolicyLoss:
    """Validate a mapping such as ``{"name": "sapo", "tau_neg": 1.05}`` (or pass a built loss through)."""
    return TypeAdapter(PolicyLossConfig).validate_python(config)


def policy_loss(
    name: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **settings: Any,
) -> tuple[torch.Tensor, Metrics]:
    """One-call form for scripts: ``policy_loss("sapo", logp_bt, old_logp_bt, adv, mask_bt, tau_neg=1.05)``.

    ``settings`` are the loss's fields (``tau_pos``, ``eps_low``, ``agg``, ``max_len``, ...) plus the keyword
    arguments of ``compute`` (``rollout_logp_bt``, ``correction`` (model or mapping), ``num_tokens``, ...).
    """
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}")
    fields = [f for f in POLICY_LOSSES[name].model_fields if f != "name"]
    accepted = sorted([*fields, *COMPUTE_KWARGS])
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown} for policy loss {name!r}; accepted: {accepted}")
    loss_fn = POLICY_LOSSES[name].model_validate(
        {"name": name, **{k: v for k, v in settings.items() if k in fields}}
    )
    kwargs = {k: v for k, v in settings.items() if k in COMPUTE_KWARGS}
    if isinstance(kwargs.get("correction"), Mapping):
        kwargs["correction"] = TypeAdapter(MismatchCorrectionConfig).validate_python(kwargs["correction"])
    return loss_fn.compute(logp, old_logp, advantages, mask, **kwargs)
