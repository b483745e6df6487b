"""Pure tensor math of the RL step: policy losses, loss aggregation, advantages, mismatch correction, and
on-policy distillation (OPD advantages, SAF, fusion with the RL advantage).

No megatron, no torch.distributed, no I/O: global normalisers and other cross-rank quantities are arguments.
"""

from sapo_megatron.algo.advantages import (
    AdvantageConfig,
    grpo_advantages,
    nonconstant_groups,
    overlong_penalty,
)
from sapo_megatron.algo.aggregation import AGG_MODES, AggMode, aggregate, masked_mean, token_weights
from sapo_megatron.algo.loss_registry import (
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossConfig,
    build_policy_loss,
    policy_loss,
)
from sapo_megatron.algo.losses import GrpoLoss, GspoLoss, SapoLoss
from sapo_megatron.algo.losses_baselines import CispoLoss, DppoLoss, GmpoLoss, M2poLoss, m2po_keep_mask
from sapo_megatron.algo.mismatch import (
    TIS,
    IcePop,
    MismatchCorrection,
    MismatchCorrectionConfig,
    NoCorrection,
    mismatch_metrics,
)
from sapo_megatron.algo.opd import (
    FUSION_MODES,
    FixedFusion,
    Fusion,
    FusionConfig,
    MopdFusion,
    OpdFusion,
    RlFusion,
    SafAnneal,
    SafCompress,
    SafFusion,
    SafSparsify,
    SafWarmup,
    check_fusion_loss,
    fuse_advantages,
    mopd_is_weight,
    opd_advantages,
    opd_k3,
    opd_reverse_kl,
    route_by_domain,
)
from sapo_megatron.algo.saf import SAFSchedule, saf_compress, saf_keep_mask, saf_sparsify

__all__ = [
    "AGG_MODES",
    "FUSION_MODES",
    "POLICY_LOSSES",
    "TIS",
    "AdvantageConfig",
    "AggMode",
    "CispoLoss",
    "DppoLoss",
    "FixedFusion",
    "Fusion",
    "FusionConfig",
    "GmpoLoss",
    "GrpoLoss",
    "GspoLoss",
    "IcePop",
    "M2poLoss",
    "MismatchCorrection",
    "MismatchCorrectionConfig",
    "MopdFusion",
    "NoCorrection",
    "OpdFusion",
    "PolicyLoss",
    "PolicyLossConfig",
    "RlFusion",
    "SAFSchedule",
    "SafAnneal",
    "SafCompress",
    "SafFusion",
    "SafSparsify",
    "SafWarmup",
    "SapoLoss",
    "aggregate",
    "build_policy_loss",
    "check_fusion_loss",
    "fuse_advantages",
    "grpo_advantages",
    "m2po_keep_mask",
    "masked_mean",
    "mismatch_metrics",
    "mopd_is_weight",
    "nonconstant_groups",
    "opd_advantages",
    "opd_k3",
    "opd_reverse_kl",
    "overlong_penalty",
    "policy_loss",
    "route_by_domain",
    "saf_compress",
    "saf_keep_mask",
    "saf_sparsify",
    "token_weights",
]
