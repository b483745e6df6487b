"""Distillation end to end in the RL loop (a real ``sapo-megatron train`` subprocess): on a fixed seed the
student's reverse KL to its teacher falls during an OPD run, and every distillation metric is logged."""

from __future__ import annotations

import pytest

from tests.distill.models import make_teacher
from tests.rl.test_trainer import data_files, metrics, train, write_config  # noqa: F401 - fixture reused


@pytest.fixture(scope="module")
def opd_run(tmp_path_factory, data_files):  # noqa: F811
    root = tmp_path_factory.mktemp("opd")
    teacher = make_teacher(root / "teacher", sharpen=6.0)  # peaked: far from the fresh student
    config = write_config(
        root / "run.yaml",
        data_files,
        **{
            "sft.steps": 0,
            "trainer.steps": 12,
            "trainer.prompts_per_step": 8,
            "trainer.mini_batches": 1,
            "rollout.n_samples": 4,
            "optimizer.lr": 1e-3,
            "teachers": [{"name": "peaked", "model_path": str(teacher), "cpu_http": True}],
            "algorithm.fusion": {"mode": "opd"},
            "trainer.export_hf": False,
        },
    )
    train(config)
    return metrics(config.parent / "run", "rl")


def test_reverse_kl_to_the_teacher_falls_during_opd(opd_run):
    kl = [row["opd/reverse_kl"] for row in opd_run]
    assert len(kl) == 12
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert last < 0.8 * first, f"reverse KL {first:.3f} -> {last:.3f}: {kl}"


def test_distillation_metrics_are_logged(opd_run):
    row = opd_run[0]
    for key in (
        "opd/adv_abs_mean",
        "adv/fused_abs_mean",
        "adv/rl_abs_mean",
        "time/teacher_s",
        "time/teacher_wait_s",
        "teacher/errors",
        "teacher/sequences",
        "teacher/peaked/sequences",
    ):
        assert key in row, key
    assert row["teacher/sequences"] == 32 and row["teacher/errors"] == 0
    assert row["adv/fused_abs_mean"] == pytest.approx(row["opd/adv_abs_mean"])  # opd: A = A_opd
