"""The colocated step end to end (``rollout.colocation: time_shared``; the CPU server in the trainer's process stands in for the
colocated SGLang servers): the same run disaggregated, colocated with the trainer resident, and colocated with the
trainer offloaded and the weights checked after every sync gives the same metrics bit for bit, and the colocated
runs log each phase's time and the trainer's device memory."""

from __future__ import annotations

import pytest

from tests.rl.test_trainer import data_files, metrics, train, write_config  # noqa: F401 (fixture)

BASE = {
    "rollout.engine": "cpu_http",
    "rollout.weight_sync": "tensor",
    "trainer.steps": 3,
    "trainer.save_every": 2,  # a checkpoint of an offloaded trainer (it comes back for the save)
    "sft.steps": 5,
}
TIMING = ("time/", "colocate/", "throughput/")
# The CPU server batches the requests that arrive within a few milliseconds of each other, so the rollout
# log-probs (and the train-vs-rollout mismatch metrics built on them) change in the 9th digit with timing, in any
# two runs; everything the trainer computes is compared bit for bit.
SERVER_TIMED = ("mismatch/",)


def _numbers(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING + SERVER_TIMED)} for row in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_files):  # noqa: F811 - the fixture imported above
    arms = {
        "disaggregated": {},
        "resident": {"rollout.colocation": {"name": "time_shared", "offload_trainer": False}},
        "offloaded": {
            "rollout.colocation": {
                "name": "time_shared",
                "offload_trainer": True,
                "check_weights": True,
                "bucket_mb": 1,
            }
        },
    }
    out = {}
    for name, extra in arms.items():
        root = tmp_path_factory.mktemp(name)
        train(write_config(root / "run.yaml", data_files, **BASE, **extra))
        out[name] = metrics(root / "run", "rl")
    return out


def test_colocated_runs_are_bitwise_the_disaggregated_run(runs):
    reference = _numbers(runs["disaggregated"])
    assert len(reference) == 3 and reference[0]["grad_norm"] != reference[-1]["grad_norm"]
    for arm in ("resident", "offloaded"):
        got = _numbers(runs[arm])
        differ = [
            (i, k, a.get(k), b.get(k))
            for i, (a, b) in enumerate(zip(got, reference))
            for k in a | b
            if a.get(k) != b.get(k)
        ]
        assert not differ and len(got) == 3, (arm, differ)
        for row, ref in zip(runs[arm], runs["disaggregated"]):
            assert row["mismatch/abs_delta_mean"] == pytest.approx(ref["mismatch/abs_delta_mean"], abs=1e-8)


def test_colocated_steps_log_phases_and_memory(runs):
    for row in runs["offloaded"]:
        for phase in (
            "release",
            "onload",
            "offload",
            "resume_weights",
            "sync",
            "offload_params",
            "resume_kv",
            "check",
        ):
            assert row[f"colocate/{phase}_s"] >= 0.0, phase
        assert (
            row["colocate/trainer_resident_gib_rollout"] == 0.0
        )  # nothing left on the device while generating
        assert row["colocate/trainer_resident_gib_train"] > 0.0
    for row in runs["resident"]:
        assert "colocate/onload_s" not in row and row["colocate/release_s"] >= 0.0
    assert not any(k.startswith("colocate/") for k in runs["disaggregated"][0])


def test_two_rank_colocated_run_is_bitwise_the_disaggregated_one(tmp_path, data_files):  # noqa: F811
    """TP2 (sequence parallel) on two processes: the engine calls stay on rank 0, onload / offload and the
    collectives around them run on both ranks in the same order, and the trainer's numbers do not move."""
    tp2 = {"parallel": {"tp": 2, "sequence_parallel": True}, "launch.procs_per_node": 2}
    got = {}
    for name, extra in (
        ("plain", {}),
        ("colocated", {"rollout.colocation": {"name": "time_shared", "check_weights": True}}),
    ):
        (tmp_path / name).mkdir()
        train(write_config(tmp_path / name / "run.yaml", data_files, **BASE, **tp2, **extra))
        got[name] = metrics(tmp_path / name / "run", "rl")
    assert len(got["plain"]) == 3 and _numbers(got["colocated"]) == _numbers(got["plain"])
    assert all(row["colocate/trainer_resident_gib_rollout"] == 0.0 for row in got["colocated"])
