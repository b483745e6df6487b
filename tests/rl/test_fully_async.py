"""``trainer.rollout_mode: fully_async`` end to end (real ``sapo-megatron train`` processes on the embedded demo
config, in-process CPU engine): the deterministic schedule's exact staleness, stale groups dropped or kept with
the correction, the producer thread, and the loglinear proximal approximation."""

from __future__ import annotations

from pathlib import Path

import pytest

from sapo_megatron.loop.fully_async import BUFFER_FILE
from tests.rl.test_interrupt_resume import interrupted
from tests.rl.test_trainer import data_files, metrics, run_cli, train, write_config  # noqa: F401 - the fixture

FAST = {"sft.steps": 2, "trainer.export_hf": False, "trainer.mini_batches": 1, "eval.every": 0}


def run(tmp_path: Path, data_files: dict[str, str], **overrides) -> list[dict]:  # noqa: F811
    settings = {**FAST, "trainer.rollout_mode": "fully_async", **overrides}
    config = write_config(tmp_path / "run.yaml", data_files, **settings)
    train(config)
    return metrics(tmp_path / "run", "rl")


def column(rows: list[dict], key: str) -> list[float]:
    return [row[key] for row in rows]


def test_deterministic_schedule_is_max_staleness_behind(tmp_path, data_files):  # noqa: F811
    rows = run(
        tmp_path,
        data_files,
        **{"trainer.steps": 4, "trainer.prompts_per_step": 4, "trainer.max_staleness": 2},
        **{"trainer.fully_async_deterministic": True},
    )
    # the buffer holds 3 steps of groups: step s trains the groups generated at version max(0, s - 2)
    assert column(rows, "staleness/token_mean") == [0.0, 1.0, 2.0, 2.0]
    assert column(rows, "staleness/sample_max") == [0.0, 1.0, 2.0, 2.0]
    assert column(rows, "staleness/tokens_2") == [0.0, 0.0, 1.0, 1.0]
    assert column(rows, "async/buffer_groups") == [
        12.0,
        12.0,
        8.0,
        4.0,
    ]  # never more than the run still needs
    assert column(rows, "async/stale_dropped_groups") == [0.0] * 4
    assert all(row["async/buffer_fill"] <= 1.0 for row in rows)


@pytest.mark.parametrize("policy", ["drop", "correct"])
def test_stale_groups_are_dropped_or_trained_with_the_correction(tmp_path, data_files, policy):  # noqa: F811
    rows = run(
        tmp_path,
        data_files,
        **{"trainer.steps": 3, "trainer.prompts_per_step": 2, "trainer.max_staleness": 0},
        **{"trainer.fully_async_deterministic": True, "trainer.async_buffer_groups": 4},
        **{"trainer.stale_groups": policy, "algorithm.correction": {"name": "tis", "cap": 2.0}},
    )
    if (
        policy == "drop"
    ):  # the producer generates only what the bound lets the trainer use: one step ahead at most
        assert column(rows, "async/buffer_groups") == [2.0, 2.0, 2.0]
        assert column(rows, "async/stale_dropped_groups") == [0.0, 0.0, 0.0]
        assert column(rows, "staleness/token_mean") == [0.0, 0.0, 0.0]
        return
    # correct: the buffer fills to its 4 groups; steps 1 and 2 train groups one version behind
    assert column(rows, "async/stale_kept_groups") == [0.0, 2.0, 2.0]
    assert column(rows, "staleness/token_mean") == [0.0, 1.0, 1.0]
    # the correction's input: the proximal policy (trainer, version s) against the behaviour policy (version s-1)
    delta = column(rows, "mismatch/abs_delta_mean")
    assert delta[1] > 10 * delta[0] and delta[2] > 10 * delta[0]
    assert rows[1]["mismatch/is_weight_mean"] != pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("inflight", [1, 2])
def test_producer_thread_trains_within_the_bound(tmp_path, data_files, inflight):  # noqa: F811
    """``inflight`` 2: two chunks of 2 groups in flight at once on the in-process CPU engine, paused together by
    the weight update."""
    chunks = {"trainer.async_inflight_chunks": inflight, "trainer.async_chunk_groups": 4 // inflight}
    rows = run(tmp_path, data_files, **{"trainer.steps": 2, "trainer.prompts_per_step": 4}, **chunks)
    assert len(rows) == 2
    assert all(row["staleness/token_max"] <= 1.0 for row in rows)  # max_staleness 1 by default
    assert rows[0]["staleness/token_max"] == 0.0
    assert all(row["time/trainer_idle_s"] >= 0.0 and row["time/generation_idle_s"] >= 0.0 for row in rows)
    # trainer.pause_mode in_place (default): an update pauses the chunk in flight; step 0's batch never spans one,
    # and step 1's only if step 0's update paused a chunk
    assert rows[0]["async/partial_samples_frac"] == 0.0
    assert rows[1]["async/partial_samples_frac"] <= rows[0]["weight_sync/paused"]


COMPARED = (
    "reward/mean",
    "loss/total",
    "grad_norm",
    "staleness/token_mean",
    "async/buffer_groups",
    "ratio/mean",
)


def test_sigint_then_resume_trains_the_saved_buffer_once(tmp_path, data_files):  # noqa: F811
    """The checkpoint holds the buffer (groups generated at older versions); the resumed run trains exactly the
    groups the uninterrupted run trains – none twice, none lost – so every logged number is equal."""
    settings = {
        **FAST,
        "trainer.rollout_mode": "fully_async",
        "trainer.fully_async_deterministic": True,
        "trainer.steps": 4,
        "trainer.prompts_per_step": 4,
        "trainer.max_staleness": 2,
    }
    for name in ("straight", "resumed"):
        (tmp_path / name).mkdir()
    straight = write_config(tmp_path / "straight" / "run.yaml", data_files, **settings)
    train(straight)
    config = write_config(tmp_path / "resumed" / "run.yaml", data_files, **settings)
    interrupted(config, "rl:2")
    checkpoint = tmp_path / "resumed" / "run" / "checkpoints" / "step_000002"
    assert (checkpoint / BUFFER_FILE).is_file()
    train(config, "--resume")

    def compared(run: Path) -> list[dict]:
        return [{key: row[key] for key in COMPARED} for row in metrics(run, "rl")]

    resumed = compared(tmp_path / "resumed" / "run")
    assert [row["staleness/token_mean"] for row in resumed] == [0.0, 1.0, 2.0, 2.0]
    assert resumed == compared(tmp_path / "straight" / "run")


def test_two_steps_on_the_embedded_demo(tmp_path):
    """``sapo-megatron train`` without a config file (the embedded demo) and ``rollout_mode: fully_async``: the
    producer thread keeps generating (the second chunk starts on version 0 while step 1 trains) into a buffer of
    (max_staleness + 1) × prompts_per_step groups."""
    run = tmp_path / "run"
    overrides = {
        "output_dir": run,
        "trainer.rollout_mode": "fully_async",
        "trainer.steps": 2,
        "sft.steps": 0,
        "trainer.export_hf": "false",
    }
    train_args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    run_cli(["-m", "sapo_megatron.cli"], "train", *train_args)
    rows = metrics(run, "rl")
    assert [row["step"] for row in rows] == [1, 2]
    assert column(rows, "staleness/token_max") == [0.0, 1.0]  # step 2 trains groups of version 0
    for row in rows:  # the default capacity: (1 + 1) × 32 groups
        assert (
            row["async/buffer_groups"] <= 64 and row["async/buffer_fill"] == row["async/buffer_groups"] / 64
        )


def test_dynamic_sampling_and_over_sampling_apply_to_every_chunk(tmp_path, data_files):  # noqa: F811
    rows = run(
        tmp_path,
        data_files,
        **{"trainer.steps": 2, "trainer.prompts_per_step": 4, "trainer.fully_async_deterministic": True},
        **{"algorithm.dynamic_sampling": True, "algorithm.over_sampling": 1.5},
    )
    # each chunk (4 groups) drew ceil(4 × 1.5) − 4 = 2 extra prompts in its first round, as a sync step would
    assert column(rows, "rollout/over_sampled_prompts")[0] >= 2.0
    assert all(row["rollout/rounds"] >= 1.0 for row in rows)
    assert column(rows, "staleness/token_mean") == [0.0, 1.0]


def drawn(prompt_state: dict) -> int:
    """Prompts the iterator has handed out (every epoch is ``num_rows`` long)."""
    return int(prompt_state["epoch"]) * int(prompt_state["num_rows"]) + int(prompt_state["position"])


def test_sigint_then_resume_with_two_chunks_in_flight_trains_every_prompt_once(tmp_path, data_files):  # noqa: F811
    """The threaded producer with 2 chunks of 2 groups in flight (they finish in any order): the checkpoint is
    taken with no chunk in flight, so every prompt drawn before it was trained (2 steps × 4 groups) or is in the
    saved buffer; the resumed run trains the buffer first and draws exactly the prompts the rest of the run
    needs – 4 steps × 4 groups drawn in all, none dropped: no group trained twice, none lost."""
    import torch

    from sapo_megatron.checkpoint.atomic import read_marker

    settings = {
        **FAST,
        "trainer.rollout_mode": "fully_async",
        "trainer.steps": 4,
        "trainer.prompts_per_step": 4,
        "trainer.max_staleness": 2,
        "trainer.async_inflight_chunks": 2,
        "trainer.async_chunk_groups": 2,
    }
    config = write_config(tmp_path / "run.yaml", data_files, **settings)
    interrupted(config, "rl:2")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    saved = torch.load(checkpoint / BUFFER_FILE, weights_only=True)
    assert drawn(saved["prompt_state"]) == 2 * 4 + len(saved["groups"])
    train(config, "--resume")
    rows = metrics(tmp_path / "run", "rl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(row["staleness/token_max"] <= 2.0 for row in rows)
    assert column(rows, "async/stale_dropped_groups") == [0.0] * 4
    final = read_marker(tmp_path / "run" / "checkpoints" / "step_000004")
    assert drawn(final["extra"]["prompts"]) == 4 * 4
