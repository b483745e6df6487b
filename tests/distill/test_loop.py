"""Distillation end to end in the RL loop (real ``sapo-megatron train`` subprocesses): on a fixed seed the
student's reverse KL to its teacher falls during an OPD run, every distillation metric is logged, and a
pipeline-parallel run (old_logp on the last stage, the checkpointing main rank on the first) logs the same
reverse KL as the single process."""

from __future__ import annotations

import pytest

from tests.distill.models import make_teacher
from tests.rl.test_trainer import data_files, metrics, train, write_config  # noqa: F401 - fixture reused


def opd_settings(teacher) -> dict:
    return {
        "sft.steps": 0,
        "trainer.steps": 12,
        "trainer.prompts_per_step": 8,
        "trainer.mini_batches": 1,
        "rollout.n_samples": 4,
        "optimizer.lr": 1e-3,
        "teachers": [{"name": "peaked", "model_path": str(teacher), "engine": "cpu_http"}],
        "algorithm.fusion": {"mode": "opd"},
        "trainer.export_hf": False,
    }


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return make_teacher(
        tmp_path_factory.mktemp("teacher") / "hf", sharpen=6.0
    )  # peaked: far from the student


@pytest.fixture(scope="module")
def opd_run(tmp_path_factory, data_files, teacher):  # noqa: F811
    config = write_config(tmp_path_factory.mktemp("opd") / "run.yaml", data_files, **opd_settings(teacher))
    train(config)
    return config.parent / "run"


def test_reverse_kl_to_the_teacher_falls_during_opd(opd_run):
    kl = [row["opd/reverse_kl"] for row in metrics(opd_run, "rl")]
    assert len(kl) == 12
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert last < 0.8 * first, f"reverse KL {first:.3f} -> {last:.3f}: {kl}"


def test_distillation_metrics_are_logged(opd_run):
    row = metrics(opd_run, "rl")[0]
    for key in (
        "opd/adv_abs_mean",
        "adv/fused_abs_mean",
        "adv/rl_abs_mean",
        "time/teacher_s",
        "time/teacher_wait_s",
        "teacher/errors",
        "teacher/sequences",
        "teacher/peaked/sequences",
        "opd/student_teacher_k3",
        "ratio/p50",
        "policy/kl_old",
    ):
        assert key in row, key
    assert row["teacher/sequences"] == 32 and row["teacher/errors"] == 0
    assert row["adv/fused_abs_mean"] == pytest.approx(row["opd/adv_abs_mean"])  # opd: A = A_opd


def test_a_pipeline_parallel_run_logs_the_same_reverse_kl(tmp_path, data_files, teacher, opd_run):  # noqa: F811
    # The same starting weights: the single-process run's initial export (Megatron's random init is seeded
    # per pipeline stage, so a random init would differ between layouts).
    start = str(opd_run / "rollout_weights" / "initial")
    settings = {
        **opd_settings(teacher),
        "trainer.steps": 2,
        "parallel": {"pp": 2},
        "launch.procs_per_node": 2,
    }
    settings.update({"model.init": "hf", "model.init_path": start})
    train(write_config(tmp_path / "run.yaml", data_files, **settings))
    pp2, single = metrics(tmp_path / "run", "rl"), metrics(opd_run, "rl")
    # Step 1: the same samples, teacher and weights; old_logp comes from the last stage (fp32 layout rounding).
    assert pp2[0]["opd/reverse_kl"] == pytest.approx(single[0]["opd/reverse_kl"], rel=1e-5)
    assert pp2[0]["opd/adv_abs_mean"] == pytest.approx(single[0]["opd/adv_abs_mean"], rel=1e-5)
    assert pp2[1]["opd/reverse_kl"] == pytest.approx(single[1]["opd/reverse_kl"], rel=1e-3)  # after an update


@pytest.mark.slow
def test_opd_with_a_vl_teacher_scores_the_image_prompts_with_their_images(tmp_path):
    """An OPD run on prompts with images whose teacher (over HTTP: the CPU server, SGLang's wire format) is the
    student's initial checkpoint: at step 1 the teacher scores the sampled responses as the policy that sampled
    them did, so the reverse KL is ~0 – which it is only when the teacher gets each prompt's images (without them
    its log-probs are of other inputs); after an update the student has moved away from it."""

    import yaml

    from tests.vl_fixtures import build_tiny_vl_checkpoint, image_prompt_records, vl_run_config, write_jsonl

    model = build_tiny_vl_checkpoint(tmp_path / "model", seed=3)
    train_file = write_jsonl(tmp_path / "train.jsonl", image_prompt_records(colours=3))
    teacher = {"name": "vl", "model_path": str(model), "engine": "cpu_http"}
    cfg = vl_run_config(model, train_file, tmp_path / "run", teachers=[teacher])
    cfg["optimizer"]["lr"] = 1e-2
    cfg["trainer"].update(steps=2, prompts_per_step=4, mini_batches=1, save_every=0, export_hf=False)
    cfg["rollout"].update(n_samples=2, max_new_tokens=4, temperature=1.0)
    cfg["algorithm"].update(reward="exact_match", fusion={"mode": "opd"})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    train(config)
    rl = metrics(tmp_path / "run", "rl")
    kl = [row["opd/reverse_kl"] for row in rl]
    print(f"OPD with a VL teacher (= the initial student): reverse KL per step {kl}")
    assert [row["teacher/sequences"] for row in rl] == [8.0, 8.0]
    assert all(row["teacher/errors"] == 0 for row in rl)
    assert abs(kl[0]) < 1e-5  # teacher = policy, images included
    assert abs(kl[1]) > 1e-4  # the update moved the student: the teacher's scores are not the rollout's
