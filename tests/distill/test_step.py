"""The distillation step on the trainer side: fused token advantages in the micro-batches, the student log-prob
setting, the SAF schedule stepped once per RL step with the global reverse KL, its checkpointed state, and the
same numbers under data and pipeline parallelism (gloo, 2 ranks) as on one process."""

from __future__ import annotations

import pytest
import torch

from sapo_megatron.algo import IcePop, NoCorrection, fuse_advantages, opd_advantages
from sapo_megatron.distill.step import DistillStep
from sapo_megatron.model.batching import SEQUENCE_INDEX, TrainSequence, build_micro_batches
from sapo_megatron.model.packing import SequenceView
from tests.distill.step_scenarios import DOMAINS, SAF, distill_config, fuse, make_batches
from tests.distributed import run_distributed


def _reverse_kl(batches, key="old_logp") -> float:
    gaps = [(b[key] - b["teacher_logp"])[b["loss_mask"].bool()] for b in batches]
    return float(torch.cat(gaps).double().mean())


def test_opd_replaces_advantages_by_the_token_gap_and_reports_the_global_reverse_kl():
    batches = make_batches()
    expected = [opd_advantages(b["teacher_logp"], b["old_logp"], b["loss_mask"]) for b in batches]
    metrics = fuse(DistillStep(distill_config({"mode": "opd"}), DOMAINS), [batches[:2], batches[2:]])
    for batch, adv in zip(batches, expected):
        assert batch["advantages"].shape == batch["loss_mask"].shape
        assert torch.equal(batch["advantages"], adv)
    assert metrics["opd/reverse_kl"] == pytest.approx(_reverse_kl(batches), rel=1e-12)
    tokens = [b["loss_mask"].bool() for b in batches]
    abs_mean = torch.cat([a[m] for a, m in zip(expected, tokens)]).abs().mean()
    assert metrics["opd/adv_abs_mean"] == pytest.approx(float(abs_mean), rel=1e-6)
    for d, domain in enumerate(DOMAINS):  # two domains in the data: per-domain reverse KL
        rows = [m & (b["domain_ids"] == d)[:, None] for b, m in zip(batches, tokens)]
        gap = torch.cat([(b["old_logp"] - b["teacher_logp"])[r] for b, r in zip(batches, rows)]).mean()
        assert metrics[f"opd/reverse_kl/{domain}"] == pytest.approx(float(gap), rel=1e-6)


def test_the_engines_log_prob_as_student_changes_the_advantage():
    trainer, engine = make_batches(), make_batches()
    fuse(DistillStep(distill_config({"mode": "opd"}), DOMAINS), [trainer])
    metrics = fuse(DistillStep(distill_config({"mode": "opd"}, opd_student_logp="engine"), DOMAINS), [engine])
    for a, b in zip(trainer, engine):
        assert torch.equal(
            b["advantages"], opd_advantages(b["teacher_logp"], b["rollout_logp"], b["loss_mask"])
        )
        assert not torch.equal(a["advantages"], b["advantages"])
    assert metrics["opd/reverse_kl"] == pytest.approx(_reverse_kl(engine, "rollout_logp"), rel=1e-12)


def test_rl_mode_only_measures_and_runs_without_teachers_do_nothing():
    batches = make_batches()
    before = [b["advantages"].clone() for b in batches]
    metrics = fuse(DistillStep(distill_config({"mode": "rl"}), DOMAINS), [batches])
    assert all(torch.equal(b["advantages"], a) for b, a in zip(batches, before))
    assert metrics["opd/reverse_kl"] == pytest.approx(_reverse_kl(batches), rel=1e-12)
    plain = distill_config({"mode": "rl"}).model_copy(update={"teachers": []})
    assert fuse(DistillStep(plain), [batches]) == {}


def test_fixed_and_mopd_fusion_and_mopds_correction():
    batches = make_batches()
    reference = [
        fuse_advantages(
            distill_config({"mode": "fixed", "coef": 0.5}).algorithm.fusion,
            b["advantages"],
            opd_advantages(b["teacher_logp"], b["old_logp"], b["loss_mask"]),
            b["loss_mask"],
        )[0]
        for b in batches
    ]
    fuse(DistillStep(distill_config({"mode": "fixed", "coef": 0.5}), DOMAINS), [batches])
    assert all(torch.equal(b["advantages"], r) for b, r in zip(batches, reference))
    mopd = DistillStep(distill_config({"mode": "mopd", "eps_low": 0.3, "eps_high": 3.0}), DOMAINS)
    assert mopd.correction(NoCorrection()) == IcePop(low=0.3, high=3.0)
    assert DistillStep(distill_config({"mode": "opd"})).correction(NoCorrection()) == NoCorrection()


def test_saf_schedule_steps_with_the_previous_updates_kl_and_resumes_exactly():
    """The authors' signal: the k3 of the update before (``observe``), none at the first step."""
    step = DistillStep(distill_config(SAF), DOMAINS)  # W = 4, δ = 0.2, R = 4
    first = fuse(step, [make_batches(0)])
    assert (first["saf/scale"], first["saf/coef"], first["saf/multiplier"]) == (0.25, 1.0, 0.25)
    assert "saf/kl_signal" not in first and step.schedule.kl_first is None
    assert first["opd/reverse_kl"] == pytest.approx(_reverse_kl(make_batches(0)), rel=1e-12)  # still logged
    step.observe({"opd/student_teacher_k3": 0.5})
    second = fuse(step, [make_batches(1)])
    assert (second["saf/kl_signal"], step.schedule.kl_first, second["saf/scale"]) == (0.5, 0.5, 0.5)
    step.observe({"opd/student_teacher_k3": 0.3})  # pending: a 40 % drop ends warm-up at step 3
    saved = step.state_dict()
    resumed = DistillStep(distill_config(SAF), DOMAINS)
    resumed.load_state_dict(saved)
    multipliers = []
    for seed in (2, 3, 4, 5):
        a, b = make_batches(seed), make_batches(seed)
        metrics = fuse(step, [a])
        assert metrics == fuse(resumed, [b])
        assert all(torch.equal(x["advantages"], y["advantages"]) for x, y in zip(a, b))
        multipliers.append(metrics["saf/multiplier"])
        for each in (step, resumed):
            each.observe({"opd/student_teacher_k3": 0.1})
    assert multipliers == pytest.approx([0.75, 0.75 * 0.75, 0.75 * 0.5, 0.75 * 0.25])
    fresh = DistillStep(distill_config(SAF), DOMAINS)  # without the saved state it would start over
    assert fuse(fresh, [make_batches(2)])["saf/multiplier"] == 0.25 != multipliers[0]


def _scored_sequences(seed: int = 0, count: int = 12) -> list[TrainSequence]:
    """Sequences as a teacher returns them; their trainer log-probs ride along as the ``old_logp`` token key."""
    gen = torch.Generator().manual_seed(seed)
    sequences = []
    for index in range(count):
        prompt, response = (
            int(torch.randint(2, 6, (1,), generator=gen)),
            int(torch.randint(1, 12, (1,), generator=gen)),
        )

        def values(scale: float, n: int = response) -> list[float]:
            return (-torch.rand(n, generator=gen) * scale).tolist()

        sequences.append(
            TrainSequence(
                [1] * prompt,
                [2] * response,
                advantage=float(torch.randn(1, generator=gen)),
                rollout_logp=values(2.0),
                teacher_logp=values(3.0),
                domain_id=index % 2,
                sample_id=f"s{index}",
                token_values={"old_logp": values(2.0)},
            )
        )
    return sequences


def _fused_per_sequence(batches: list[dict]) -> dict[int, torch.Tensor]:
    """Each sequence's fused advantages on its response tokens, by its index in the batch."""
    out = {}
    for batch in batches:
        view = SequenceView(batch)
        advantages, mask = view(batch["advantages"]), view(batch["loss_mask"]).bool()
        for row, index in enumerate(batch[SEQUENCE_INDEX].tolist()):
            out[index] = advantages[row][mask[row]]
    return out


@pytest.mark.parametrize("fusion", [{"mode": "mopd", "eps_low": 0.3, "eps_high": 3.0}, SAF])
def test_packed_micro_batches_fuse_like_padded_ones(fusion):
    """Teacher log-probs and domain ids follow the packed layout: the same fused advantages per sequence and
    the same metrics (summation order aside) as right-padded micro-batches."""
    sequences = _scored_sequences()
    build = dict(dp_rank=0, dp_size=1, micro_batches=2, pad_id=0)
    padded = build_micro_batches(sequences, **build)
    packed = build_micro_batches(sequences, **build, max_tokens_per_micro_batch=24)
    assert len(packed) > 2 and all(b["input_ids"].shape[0] == 1 for b in packed)
    metrics = {}
    for name, batches in (("padded", padded), ("packed", packed)):
        metrics[name] = fuse(DistillStep(distill_config(fusion), DOMAINS), [batches])
    assert metrics["packed"].keys() == metrics["padded"].keys()
    assert metrics["packed"] == pytest.approx(metrics["padded"], rel=1e-6, abs=1e-9)
    assert metrics["packed"]["opd/reverse_kl/multiplication"] != metrics["packed"]["opd/reverse_kl/addition"]
    expected, got = _fused_per_sequence(padded), _fused_per_sequence(packed)
    assert got.keys() == expected.keys() == set(range(len(sequences)))
    for index, advantages in expected.items():
        assert len(advantages) == len(sequences[index].response_ids)
        torch.testing.assert_close(got[index], advantages, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from sapo_megatron.model.tiny import make_tiny_hf_checkpoint

    hf_dir = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("student") / "hf", "dense", seed=3)
    return run_distributed("tests.distill.step_scenarios:two_ranks", 2, {"hf_dir": str(hf_dir), "world": 2})


@pytest.mark.parametrize("layout", ["dp", "pp"])
def test_data_and_pipeline_parallel_ranks_fuse_like_one_process(two_ranks, layout):
    ranks = [result["layouts"][layout] for result in two_ranks]
    single = DistillStep(distill_config(SAF), DOMAINS)
    for index, seed in enumerate((0, 1)):
        batches = make_batches(seed)
        expected = fuse(single, [batches[:2], batches[2:]])
        for result in ranks:
            got = result["metrics"][index]
            assert got.keys() == expected.keys()
            assert got == pytest.approx(expected, rel=1e-9)
        if layout == "dp":
            fused = [ranks[0]["advantages"][index], ranks[1]["advantages"][index]]
            for r in (0, 1):
                assert all(torch.equal(a, b["advantages"]) for a, b in zip(fused[r], batches[r::2]))
        else:  # the first stage keeps its [b] advantages (nothing reads them), the last stage fuses
            assert all(a.dim() == 1 for a in ranks[0]["advantages"][index])
            assert all(
                torch.equal(a, b["advantages"]) for a, b in zip(ranks[1]["advantages"][index], batches)
            )


ALIGNED_TOLERANCE = 1e-4
"""|A_opd| of a teacher identical to the student: the CPU engine (HF transformers) and the Megatron trainer agree
to ~1e-6 in fp32 log-prob at the same weights (tests/rl/test_engine_trainer_agreement.py)."""


def test_a_teacher_identical_to_the_student_gives_zero_advantage_on_every_response_token(two_ranks):
    """On 2 data-parallel ranks of a Megatron trainer, each rank's half of the batch."""
    for result in (r["alignment"] for r in two_ranks):
        assert result["tokens"] >= 12
        assert result["aligned_max_abs"] < ALIGNED_TOLERANCE and abs(result["aligned_kl"]) < ALIGNED_TOLERANCE
        assert result["shifted_max_abs"] > 100 * ALIGNED_TOLERANCE  # one position off: the span shows it
        assert result["packed_aligned_max_abs"] < ALIGNED_TOLERANCE  # packed: teacher values follow the slots
        assert result["packed_shifted_kl"] == pytest.approx(result["shifted_kl"], rel=1e-5)
    assert two_ranks[0]["alignment"]["shifted_kl"] == two_ranks[1]["alignment"]["shifted_kl"]  # global mean


def test_the_steps_token_ratios_are_pooled_over_data_parallel_ranks(two_ranks):
    """What the ratio quantiles are computed from (sapo_megatron/megatron/step_stats.py), identical on each rank."""
    assert [r["gathered"] for r in two_ranks] == [[0.5, 1.5, 1.5]] * 2


def test_an_identical_teacher_gives_zero_advantage_at_rollout_temperature_0_7(two_ranks):
    """Teachers score at temperature 1 (in-process and served): A_opd takes the student's log-prob at 1 from
    the same old-log-prob pass; its log-prob at the sampling temperature would leave a clear gap."""
    for result in (r["alignment"] for r in two_ranks):
        for where in ("in_process", "served"):
            assert result[f"hot_{where}_max_abs"] < ALIGNED_TOLERANCE, where
            assert result[f"hot_{where}_at_sampling_temperature_max_abs"] > 100 * ALIGNED_TOLERANCE, where
