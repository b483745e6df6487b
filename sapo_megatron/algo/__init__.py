"""Pure tensor math of the RL step: policy losses, loss aggregation, advantages, mismatch correction.

No megatron, no torch.distributed, no I/O: global normalisers and other cross-rank quantities are arguments.
"""

from sapo_megatron.algo.advantages import (
    AdvantageConfig,
    grpo_advantages,
    nonconstant_groups,
    overlong_penalty,
)
from sapo_megatron.algo.aggregation import AGG_MODES, AggMode, aggregate, masked_mean, token_weights
from sapo_megatron.algo.losses import (
    POLICY_LOSSES,
    GrpoLoss,
    GspoLoss,
    PolicyLoss,
    PolicyLossConfig,
    SapoLoss,
    build_policy_loss,
    policy_loss,
)
from sapo_megatron.algo.mismatch import (
    TIS,
    IcePop,
    MismatchCorrection,
    MismatchCorrectionConfig,
    NoCorrection,
    mismatch_metrics,
)

__all__ = [
    "AGG_MODES",
    "POLICY_LOSSES",
    "TIS",
    "AdvantageConfig",
    "AggMode",
    "GrpoLoss",
    "GspoLoss",
    "IcePop",
    "MismatchCorrection",
    "MismatchCorrectionConfig",
    "NoCorrection",
    "PolicyLoss",
    "PolicyLossConfig",
    "SapoLoss",
    "aggregate",
    "build_policy_loss",
    "grpo_advantages",
    "masked_mean",
    "mismatch_metrics",
    "nonconstant_groups",
    "overlong_penalty",
    "policy_loss",
    "token_weights",
]
