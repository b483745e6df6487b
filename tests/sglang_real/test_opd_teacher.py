"""OPD with a real SGLang teacher: the tier's server (holding the checkpoint ``model_dir``) scores the student's
samples over HTTP (``teachers[].engine: sglang``), and the run logs the same reverse KL at its first step as the
same run with that checkpoint as an in-process CPU teacher – so teacher scoring through real SGLang agrees with the
project's own engine where it matters, in the loss."""

from __future__ import annotations

import pytest

from tests.rl.test_trainer import data_files, metrics, train, write_config  # noqa: F401 - fixture reused
from tests.sglang_real.conftest import API_KEY


def opd_run(tmp_path, data_files, teacher: dict) -> list[dict]:  # noqa: F811 - data_files is a fixture value here
    overrides = {
        "sft.steps": 0,
        "trainer.steps": 2,
        "trainer.prompts_per_step": 8,
        "trainer.mini_batches": 1,
        "rollout.n_samples": 4,
        "teachers": [{"name": "served", **teacher}],
        "algorithm.fusion": {"mode": "opd"},
        "trainer.export_hf": False,
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    train(write_config(tmp_path / "run.yaml", data_files, **overrides))
    return metrics(tmp_path / "run", "rl")


def test_opd_with_a_real_sglang_teacher_matches_the_cpu_teacher(
    tmp_path,
    data_files,  # noqa: F811 - the fixture imported above
    sglang_url,
    model_dir,
    monkeypatch,
):
    monkeypatch.setenv("SAPO_TEST_TEACHER_KEY", API_KEY)
    served = opd_run(
        tmp_path / "sglang",
        data_files,
        {"engine": "sglang", "urls": [sglang_url], "api_key_env": "SAPO_TEST_TEACHER_KEY"},
    )
    local = opd_run(tmp_path / "cpu", data_files, {"engine": "cpu", "model_path": str(model_dir)})
    assert len(served) == len(local) == 2
    assert served[0]["teacher/errors"] == 0 and served[0]["teacher/sequences"] == 32
    # step 1: same student, same samples (the rollout engine is the same in-process CPU engine), teacher scores
    # from SGLang vs from the CPU engine: float32 on both sides
    kl_served, kl_local = served[0]["opd/reverse_kl"], local[0]["opd/reverse_kl"]
    assert kl_served == pytest.approx(kl_local, rel=1e-2), (kl_served, kl_local)
    assert kl_served > 1e-3  # teacher and student differ: not a vacuous match
