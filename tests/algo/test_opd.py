"""OPD advantages, MOPD routing and weight, and every fusion mode, on hand-made numbers."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from sapo_megatron.algo import (
    FUSION_MODES,
    CispoLoss,
    DppoLoss,
    FixedFusion,
    FusionConfig,
    GmpoLoss,
    GrpoLoss,
    GspoLoss,
    IcePop,
    M2poLoss,
    MopdFusion,
    OpdFusion,
    RlFusion,
    SafAnneal,
    SafCompress,
    SafFusion,
    SAFSchedule,
    SafSparsify,
    SafWarmup,
    SapoLoss,
    check_fusion_loss,
    fuse_advantages,
    mopd_is_weight,
    opd_advantages,
    opd_reverse_kl,
    route_by_domain,
)

NAN, INF = float("nan"), float("inf")
parse_fusion = TypeAdapter(FusionConfig).validate_python


def assert_bt(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


# ---------------------------------------------------------------------------------------------- OPD advantages


def test_opd_advantages_by_hand_masked_and_detached():
    teacher = torch.tensor([[-1.0, -2.0, -0.5, -INF], [-0.1, -0.2, -3.0, -1.0]], requires_grad=True)
    student = torch.tensor([[-1.5, -1.0, -0.75, NAN], [-0.3, -0.2, -1.0, -4.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])  # position 0: prompt; row 0 position 3: padding
    adv = opd_advantages(teacher, student, mask)
    assert adv.tolist() == [[0.0, -1.0, 0.25, 0.0], [0.0, 0.0, -2.0, 3.0]]
    assert not adv.requires_grad and adv.grad_fn is None and adv.dtype == torch.float32
    # Reverse KL: mean of student − teacher over the 5 response tokens.
    assert opd_reverse_kl(teacher, student, mask) == pytest.approx((1.0 - 0.25 + 0.0 + 2.0 - 3.0) / 5)


def tiny_lm_token_logp(ids_bt: torch.Tensor) -> torch.Tensor:
    """Log-prob ``[batch, seq]`` of each token given the previous ones under a fixed random bigram model
    (position 0 has no prediction and gets 0)."""
    gen = torch.Generator().manual_seed(0)
    logits_vv = torch.randn(11, 11, generator=gen)
    logp_bt = torch.log_softmax(logits_vv[ids_bt[:, :-1]], -1).gather(-1, ids_bt[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(ids_bt.shape[0], 1), logp_bt], dim=1)


def test_teacher_identical_to_student_gives_zero_and_a_shifted_span_does_not():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [3, 3, 9, 1, 0, 0, 0]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0]])
    student = tiny_lm_token_logp(ids)
    teacher = tiny_lm_token_logp(ids.clone())
    adv = opd_advantages(teacher, student, mask)
    assert torch.equal(adv, torch.zeros_like(adv))
    assert opd_reverse_kl(teacher, student, mask) == 0.0
    shifted = torch.roll(teacher, shifts=1, dims=1)  # the teacher's log-probs one token off
    assert (opd_advantages(shifted, student, mask)[mask.bool()] != 0).all()


def test_opd_advantages_refuses_bad_input():
    mask = torch.tensor([[1, 1]])
    with pytest.raises(ValueError, match=r"1 response token\(s\) have a non-finite"):
        opd_advantages(torch.tensor([[-1.0, -INF]]), torch.tensor([[-1.0, -1.0]]), mask)
    with pytest.raises(ValueError, match=r"student_logp_bt has shape \(1, 3\), expected \(1, 2\)"):
        opd_advantages(torch.zeros(1, 2), torch.zeros(1, 3), mask)


# ---------------------------------------------------------------------------------------------- MOPD pieces


def test_route_by_domain_takes_each_row_from_its_domains_teacher():
    math_teacher = torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [-3.0, -3.0]])
    code_teacher = torch.tensor([[-10.0, -10.0], [-20.0, -20.0], [-30.0, -30.0]])
    routed = route_by_domain({"math": math_teacher, "code": code_teacher}, ["math", "code", "math"])
    assert routed.tolist() == [[-1.0, -1.0], [-20.0, -20.0], [-3.0, -3.0]]
    with pytest.raises(ValueError, match=r"no teacher log-probs for domain\(s\) \['chat'\]"):
        route_by_domain({"math": math_teacher}, ["math", "chat", "math"])
    with pytest.raises(ValueError, match="got 2 domains for a batch of 3 rows"):
        route_by_domain({"math": math_teacher}, ["math", "math"])


def test_mopd_is_weight_masks_ratios_outside_the_band():
    ratios = torch.tensor([[0.4, 0.5, 1.0, 2.0, 2.5, 1.0]])
    rollout = torch.full_like(ratios, -1.0)
    old = (rollout + ratios.log()).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    weight = mopd_is_weight(old, rollout, mask, eps_low=0.5, eps_high=2.0)
    assert_bt(weight, [[0.0, 0.5, 1.0, 2.0, 0.0, 0.0]])
    assert not weight.requires_grad
    # The band's edges are settings: widening it keeps 0.4 and 2.5.
    wide = MopdFusion(eps_low=0.3, eps_high=3.0).is_weight(old, rollout, mask)
    assert_bt(wide, [[0.4, 0.5, 1.0, 2.0, 2.5, 0.0]])
    # The same weight as the IcePop mismatch correction the loss already applies.
    fusion = MopdFusion(eps_low=0.5, eps_high=2.0)
    icepop = fusion.correction().weight((old - rollout).detach())
    assert torch.equal(torch.where(mask.bool(), icepop, 0.0), fusion.is_weight(old, rollout, mask))
    assert fusion.correction() == IcePop(low=0.5, high=2.0)


# ---------------------------------------------------------------------------------------------- fusion

MASK = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])  # row 0: a prompt token and a padding token
ADV_RL = torch.tensor([1.0, -0.5])
ADV_OPD = torch.tensor([[9.0, 2.0, -0.5, 0.1, -3.0, 9.0], [0.4, -0.2, 0.0, 7.0, 7.0, 7.0]])  # 9, 7: off mask
RL_BT = [[0.0, 1.0, 1.0, 1.0, 1.0, 0.0], [-0.5, -0.5, -0.5, 0.0, 0.0, 0.0]]
OPD_BT = [[0.0, 2.0, -0.5, 0.1, -3.0, 0.0], [0.4, -0.2, 0.0, 0.0, 0.0, 0.0]]
N_TOKENS = 7


def fuse(fusion, **kwargs):
    return fuse_advantages(fusion, ADV_RL, ADV_OPD, MASK, **kwargs)


def t(x: float) -> float:
    return 0.1 * math.tanh(x)


def test_rl_mode_uses_the_rl_advantage_and_only_measures_opd():
    adv, metrics = fuse(RlFusion())
    assert adv.tolist() == RL_BT
    assert metrics["opd/reverse_kl"] == pytest.approx(1.2 / N_TOKENS, rel=1e-6)
    assert metrics["opd/adv_abs_mean"] == pytest.approx(6.2 / N_TOKENS, rel=1e-6)
    assert metrics["adv/rl_abs_mean"] == pytest.approx(5.5 / N_TOKENS, rel=1e-6)
    adv_alone, metrics_alone = fuse_advantages(RlFusion(), ADV_RL, None, MASK)
    assert adv_alone.tolist() == RL_BT and "opd/reverse_kl" not in metrics_alone


def test_opd_and_fixed_modes():
    rl, opd = torch.tensor(RL_BT), torch.tensor(OPD_BT)
    assert_bt(fuse(OpdFusion())[0], opd)
    fixed, metrics = fuse(FixedFusion(coef=0.5))
    assert_bt(fixed, rl + 0.5 * opd)
    assert_bt(fuse(FixedFusion())[0], rl + opd)
    assert metrics["adv/fused_abs_mean"] == pytest.approx(float((rl + 0.5 * opd).abs().sum()) / N_TOKENS)


SAF_ALL = SafFusion(opd_coef=2.0, sparsify=SafSparsify(keep=0.5), compress=SafCompress(c=0.1))


def test_saf_all_stages_by_hand():
    # keep 0.5: row 0 (n=4) keeps 2.0 and -3.0; row 1 (n=3) keeps ceil(1.5) = 2 tokens, 0.4 and -0.2.
    # coef 2 · multiplier 0.5 = 1 times c·tanh.
    adv, metrics = fuse(SAF_ALL, multiplier=0.5)
    assert_bt(
        adv,
        [
            [0.0, 1.0 + t(2.0), 1.0, 1.0, 1.0 + t(-3.0), 0.0],
            [-0.5 + t(0.4), -0.5 + t(-0.2), -0.5, 0.0, 0.0, 0.0],
        ],
    )
    assert metrics["saf/kept_frac"] == pytest.approx(4 / N_TOKENS)
    assert metrics["opd/adv_abs_mean"] == pytest.approx(6.2 / N_TOKENS, rel=1e-6)
    after = (t(2.0) + t(3.0) + t(0.4) + t(0.2)) / N_TOKENS
    assert metrics["opd/adv_abs_mean_after_saf"] == pytest.approx(after, rel=1e-6)


def opd_term(fusion, **kwargs):
    """The fused advantage minus the RL part: what the OPD branch contributed."""
    return fuse(fusion, **kwargs)[0] - torch.tensor(RL_BT)


def test_each_saf_stage_switched_off_changes_the_result_as_specified():
    no_sparsify = SAF_ALL.model_copy(update={"sparsify": None})
    assert_bt(
        opd_term(no_sparsify, multiplier=0.5),
        [[0.0, t(2.0), t(-0.5), t(0.1), t(-3.0), 0.0], [t(0.4), t(-0.2), 0.0, 0.0, 0.0, 0.0]],
    )
    assert fuse(no_sparsify, multiplier=0.5)[1]["saf/kept_frac"] == 1.0
    no_compress = SAF_ALL.model_copy(update={"compress": None})
    assert_bt(
        opd_term(no_compress, multiplier=0.5),
        [[0.0, 2.0, 0.0, 0.0, -3.0, 0.0], [0.4, -0.2, 0.0, 0.0, 0.0, 0.0]],
    )
    # The multiplier (warm-up · anneal) scales only the OPD term.
    assert_bt(opd_term(SAF_ALL, multiplier=0.25), opd_term(SAF_ALL, multiplier=0.5) / 2)
    # Warm-up and anneal off: no multiplier at all, the OPD term is coef · compress(sparsify(A_opd)).
    unscheduled = SAF_ALL.model_copy(update={"warmup": None, "anneal": None})
    assert unscheduled.build_schedule() is None
    assert_bt(opd_term(unscheduled), opd_term(SAF_ALL, multiplier=1.0))
    # With every stage off SAF is fixed fusion.
    bare = unscheduled.model_copy(update={"sparsify": None, "compress": None})
    assert_bt(fuse(bare)[0], fuse(FixedFusion(coef=2.0))[0])


def test_saf_settings_reach_the_result():
    # keep 0.75: row 0's τ = quantile([0.1, 0.5, 2, 3], 0.25) = 0.4 keeps 3 tokens; row 1's
    # τ = quantile([0, 0.2, 0.4], 0.25) = 0.1 keeps 2 (the 0.0 token falls below it).
    keep_more = SAF_ALL.model_copy(update={"sparsify": SafSparsify(keep=0.75)})
    assert fuse(keep_more, multiplier=1.0)[1]["saf/kept_frac"] == pytest.approx(5 / N_TOKENS)
    rl_weight = SAF_ALL.model_copy(update={"grpo_coef": 0.5})  # the authors' grpo_coef scales A_rl only
    assert_bt(
        fuse(rl_weight, multiplier=0.5)[0] - 0.5 * torch.tensor(RL_BT), opd_term(SAF_ALL, multiplier=0.5)
    )
    wider = SAF_ALL.model_copy(update={"compress": SafCompress(c=0.3)})
    assert_bt(opd_term(wider, multiplier=0.5), 3 * opd_term(SAF_ALL, multiplier=0.5))
    half_coef = SAF_ALL.model_copy(update={"opd_coef": 1.0})
    assert_bt(opd_term(half_coef, multiplier=0.5), opd_term(SAF_ALL, multiplier=0.5) / 2)


def test_saf_schedule_built_from_the_config():
    fusion = SafFusion(warmup=SafWarmup(steps=4, kl_drop=0.5), anneal=SafAnneal(steps=2, floor=0.5))
    schedule = fusion.build_schedule()
    direct = SAFSchedule(warmup_steps=4, kl_drop=0.5, anneal_steps=2, floor=0.5)
    kls = [1.0, 0.6, 0.4, 0.4, 0.4, 0.4]  # drops 60 % at step 3: warm-up ends there with scale 0.75
    assert [schedule.update(kl) for kl in kls] == [direct.update(kl) for kl in kls]
    assert direct.state_dict()["settings"] == schedule.state_dict()["settings"]
    assert [s for s in (direct.warmup_end_step, direct.scale, direct.coef)] == [3, 0.75, 0.5]
    anneal_only = SafFusion(warmup=None, anneal=SafAnneal(steps=4)).build_schedule()
    assert [anneal_only.update(1.0) for _ in range(3)] == [1.0, 0.75, 0.5]  # t = 0 on step 1
    warmup_only = SafFusion(anneal=None, warmup=SafWarmup(steps=2)).build_schedule()
    assert [warmup_only.update(1.0) for _ in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_mopd_routes_by_domain_applies_alpha_and_reports_per_domain():
    domains = ["math", "code"]
    student = torch.tensor([[-5.0, -1.0, -1.0, -1.0, -1.0, -5.0], [-2.0, -2.0, -2.0, -5.0, -5.0, -5.0]])
    teachers = {
        "math": torch.tensor([[0.0, -0.5, -2.0, -1.0, -0.25, 0.0], [-9.0] * 6]),  # row 1 is not math: unused
        "code": torch.tensor([[-9.0] * 6, [-1.0, -2.5, -2.0, 0.0, 0.0, 0.0]]),
    }
    adv_opd = opd_advantages(route_by_domain(teachers, domains), student, MASK)
    assert adv_opd.tolist() == [[0.0, 0.5, -1.0, 0.0, 0.75, 0.0], [1.0, -0.5, 0.0, 0.0, 0.0, 0.0]]
    adv, metrics = fuse_advantages(MopdFusion(alpha=0.5), ADV_RL, adv_opd, MASK, domains=domains)
    assert_bt(adv, [[0.0, 1.0, -0.5, 0.5, 1.25, 0.0], [0.75, -0.75, -0.25, 0.0, 0.0, 0.0]])
    assert fuse_advantages(MopdFusion(alpha=0.0), ADV_RL, adv_opd, MASK, domains=domains)[0].tolist() == (
        adv_opd.tolist()
    )
    assert metrics["opd/reverse_kl/math"] == pytest.approx(-0.25 / 4)
    assert metrics["opd/reverse_kl/code"] == pytest.approx(-0.5 / 3)
    assert metrics["opd/adv_abs_mean/math"] == pytest.approx(2.25 / 4)
    assert metrics["opd/reverse_kl"] == pytest.approx(-0.75 / N_TOKENS)


def test_fusion_argument_errors():
    with pytest.raises(ValueError, match="fusion mode 'opd' needs adv_opd_bt"):
        fuse_advantages(OpdFusion(), ADV_RL, None, MASK)
    with pytest.raises(ValueError, match="needs the step's multiplier"):
        fuse(SafFusion())
    with pytest.raises(ValueError, match="multiplier only applies to fusion mode 'saf'"):
        fuse(FixedFusion(), multiplier=0.5)
    with pytest.raises(ValueError, match="multiplier only applies"):
        fuse(SafFusion(warmup=None, anneal=None), multiplier=0.5)
    with pytest.raises(ValueError, match="'mopd' needs the rows' domains"):
        fuse(MopdFusion())
    with pytest.raises(ValueError, match=r"adv_rl_b must be \[batch\]"):
        fuse_advantages(RlFusion(), torch.ones(2, 6), None, MASK)


def test_fusion_config_parsing():
    assert [parse_fusion({"mode": m}).mode for m in FUSION_MODES] == list(FUSION_MODES)
    saf = parse_fusion({"mode": "saf", "sparsify": None, "warmup": {"steps": 10}})
    assert saf.sparsify is None and saf.compress == SafCompress(c=0.1)
    assert saf.warmup == SafWarmup(steps=10, kl_drop=0.2) and saf.anneal == SafAnneal(steps=200, floor=0.0)
    with pytest.raises(ValidationError, match="extra"):
        parse_fusion({"mode": "rl", "coef": 1.0})  # a mode owns its settings: rl has none
    with pytest.raises(ValidationError, match="extra"):
        parse_fusion({"mode": "saf", "sparsify": {"keep": 0.2, "c": 0.1}})
    with pytest.raises(ValidationError, match="less than 1"):
        parse_fusion({"mode": "saf", "anneal": {"floor": 1.0}})
    with pytest.raises(ValidationError, match="mopd needs eps_low < eps_high"):
        parse_fusion({"mode": "mopd", "eps_low": 2.0, "eps_high": 2.0})
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        parse_fusion({"mode": "kd"})


def test_sequence_level_gspo_is_refused_for_token_advantages():
    for mode in ("opd", "fixed", "saf", "mopd"):
        with pytest.raises(ValueError) as refused:
            check_fusion_loss(parse_fusion({"mode": mode}), GspoLoss(name="gspo"))
        message = str(refused.value)
        assert f"algorithm.fusion.mode={mode!r} gives token-level advantages" in message
        assert "algorithm.loss.name='gspo' cannot carry" in message
        assert "'gspo_token'" in message and "'sapo'" in message and "'grpo'" in message
    for loss in (GspoLoss(name="gspo_token"), SapoLoss(), SapoLoss(level="sequence"), GrpoLoss()):
        check_fusion_loss(SafFusion(), loss)
    check_fusion_loss(RlFusion(), GspoLoss(name="gspo"))
    # The reason is real: the gspo loss itself rejects the fused token-level advantages.
    adv, _ = fuse(FixedFusion())
    logp = torch.zeros(2, 6)
    with pytest.raises(ValueError, match="gspo needs sequence-level advantages"):
        GspoLoss(name="gspo").compute(logp, logp, adv, MASK)


def test_gmpo_is_refused_for_token_advantages_and_the_token_baselines_are_not():
    with pytest.raises(ValueError, match=r"algorithm\.loss\.name='gmpo' cannot carry"):
        check_fusion_loss(SafFusion(), GmpoLoss())
    for loss in (CispoLoss(), DppoLoss(), DppoLoss(name="dppo_kl"), M2poLoss()):
        check_fusion_loss(SafFusion(), loss)
    adv, _ = fuse(FixedFusion())
    logp = torch.zeros(2, 6)
    with pytest.raises(ValueError, match="gmpo needs sequence-level advantages"):
        GmpoLoss().compute(logp, logp, adv, MASK)
    loss, _ = CispoLoss().compute(logp.requires_grad_(), logp.detach(), adv, MASK)  # token advantages carried
    assert torch.isfinite(loss)
