"""Bad input fails early with a message that names the problem and the fix."""

from __future__ import annotations

import pytest
import torch
from pydantic import BaseModel, ValidationError

from sapo_megatron.algo import (
    TIS,
    GspoLoss,
    IcePop,
    MismatchCorrectionConfig,
    PolicyLossConfig,
    SapoLoss,
    aggregate,
    build_policy_loss,
    policy_loss,
)
from tests.algo.reference import make_batch


def test_unknown_loss_name():
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'.*gspo_token"):
        policy_loss("ppo", *make_batch())
    with pytest.raises(ValidationError):
        build_policy_loss({"name": "ppo"})


def test_unknown_setting_lists_accepted_ones():
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['eps_low'\].*accepted:.*tau_neg"):
        policy_loss("sapo", *make_batch(), eps_low=0.2)
    with pytest.raises(ValidationError, match="extra"):
        SapoLoss(eps_low=0.2)


def test_gspo_rejects_token_advantages():
    logp, old, _, mask = make_batch()
    adv_bt = torch.tensor([[1.0, 2.0, 1.0], [0.5, 0.5, 7.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match="gspo needs sequence-level advantages; use gspo_token or sapo"):
        GspoLoss().compute(logp, old, adv_bt, mask)
    GspoLoss(name="gspo_token").compute(logp, old, adv_bt, mask)  # fine
    # constant over the valid tokens (padding differs) is sequence-level
    adv_bt[0] = 1.0
    GspoLoss().compute(logp, old, adv_bt, mask)


def test_kl_without_ref():
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logp_bt"):
        policy_loss("grpo", *make_batch(), kl_coef=0.1)


def test_entropy_bonus_without_entropy():
    with pytest.raises(ValueError, match="entropy_coef > 0 needs entropy_bt"):
        policy_loss("grpo", *make_batch(), entropy_coef=0.1)


@pytest.mark.parametrize("correction", [TIS(), IcePop(), {"name": "tis", "cap": 5.0}])
def test_correction_without_rollout_logp(correction):
    with pytest.raises(ValueError, match="needs rollout_logp_bt"):
        policy_loss("sapo", *make_batch(), correction=correction)


def test_bad_agg():
    with pytest.raises(ValidationError, match="agg"):
        policy_loss("sapo", *make_batch(), agg="mean")
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "mean")


def test_sum_norm_needs_max_len():
    with pytest.raises(ValidationError, match="needs max_len"):
        SapoLoss(agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="needs max_len"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm")


def test_bad_values():
    for bad in ({"tau_pos": 0.0}, {"tau_neg": -1.0}, {"level": "chunk"}, {"max_len": 0}, {"kl_coef": -0.1}):
        with pytest.raises(ValidationError):
            SapoLoss(**bad)
    with pytest.raises(ValidationError, match="greater than 1"):
        policy_loss("grpo", *make_batch(), dual_clip=0.5)
    with pytest.raises(ValidationError, match="low < high"):
        IcePop(low=2.0, high=1.0)
    with pytest.raises(ValidationError):
        TIS(cap=0.0)


def test_shape_mismatch():
    logp, old, adv, mask = make_batch()
    with pytest.raises(ValueError, match="old_logp_bt has shape"):
        SapoLoss().compute(logp, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match="adv has shape"):
        SapoLoss().compute(logp, old, adv[:2], mask)


def test_configs_are_frozen_and_discriminated():
    class RunConfig(BaseModel):
        loss: PolicyLossConfig
        correction: MismatchCorrectionConfig = {"name": "none"}

    cfg = RunConfig(
        loss={"name": "gspo_token", "eps_high": 5e-4}, correction={"name": "icepop", "low": 0.2, "high": 5}
    )
    assert isinstance(cfg.loss, GspoLoss) and cfg.loss.name == "gspo_token" and cfg.loss.eps_high == 5e-4
    assert isinstance(cfg.correction, IcePop)
    with pytest.raises(ValidationError):
        RunConfig(loss={"name": "sapo", "eps_high": 0.3})  # a setting of another loss
    with pytest.raises(ValidationError, match="frozen"):
        cfg.loss.eps_high = 1.0
    assert build_policy_loss(cfg.loss) == cfg.loss
    assert build_policy_loss({"name": "sapo", "tau_neg": 1.2}) == SapoLoss(tau_neg=1.2)
