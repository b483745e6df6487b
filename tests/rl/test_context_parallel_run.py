"""A 2-step ``sapo-megatron train`` of the embedded demo (shrunk as tests/rl/test_trainer.py shrinks it) at
``parallel.cp: 2`` on two ranks repeats the one-process run's metrics: every number of every SFT and RL row of
``metrics.jsonl`` within 1e-5 relative (timings aside; the trainer-vs-engine ``mismatch/*`` differences, rounding
noise of ~1e-7 at either cp size, within 1e-6 absolute), so the rollouts, rewards, advantages, old-policy
log-probs, losses, gradient norms and entropies of both steps are the cp 1 run's."""

from __future__ import annotations

import math

import pytest

from tests.rl.test_trainer import data_files, metrics, train, write_config  # noqa: F401 (fixture)

RTOL = 1e-5
NOISE_ATOL = 1e-6
TIMING = ("time", "seconds", "_s", "per_s", "throughput", "elapsed", "wall")
SHORT = {"trainer.steps": 2, "sft.steps": 3}


def _numbers(row: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in row.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and not any(t in k for t in TIMING)
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_files):  # noqa: F811
    out = {}
    for name, extra in (
        ("cp1", {}),
        ("cp2", {"parallel": {"cp": 2}, "launch.procs_per_node": 2}),
    ):
        root = tmp_path_factory.mktemp(name)
        train(write_config(root / "run.yaml", data_files, **SHORT, **extra))
        out[name] = root / "run"
    return out


@pytest.mark.parametrize("phase", ["sft", "rl"])
def test_cp2_run_repeats_the_cp1_metrics(runs, phase):
    want, got = metrics(runs["cp1"], phase), metrics(runs["cp2"], phase)
    assert len(want) == len(got) >= 1
    if phase == "rl":
        assert len(got) == 2
    compared, wrong = 0, []
    for row_want, row_got in zip(want, got):
        a, b = _numbers(row_want), _numbers(row_got)
        assert set(a) == set(b)
        for key, value in a.items():
            if math.isnan(value):
                assert math.isnan(b[key]), key
                continue
            # the trainer's log-probs against the engine's: a difference of equal numbers (~1e-7 at cp 1 too)
            tolerance = {"abs": NOISE_ATOL} if key.startswith("mismatch/") else {"rel": RTOL, "abs": 1e-9}
            if b[key] != pytest.approx(value, **tolerance):
                wrong.append(f"{key}: {b[key]!r} vs {value!r}")
            compared += 1
    assert not wrong, wrong
    assert compared >= (20 if phase == "rl" else 3)
