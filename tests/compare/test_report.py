"""The report from hand-made run directories: final values by hand, the collapse rule on made-up curves,
report.json's exact shape, nulls and missing metrics, PNGs, and report.md's table and reading."""

from __future__ import annotations

import colorsys
import json
from pathlib import Path

import pytest

from sapo_megatron.compare import COLLAPSE_RULE, Arm, load_arm_result, write_report

FINAL_KEYS = [
    "reward",
    "accuracy",
    "entropy",
    "mismatch_k3",
    "routing_agreement",
    "routing_agreement_live",
    "grad_norm_max",
    "reverse_kl",
    "ratio_p99_9",
    "ratio_max",
    "kl_old",
    "clip_frac",
    "gate_w_pos",
    "gate_w_neg",
    "gate_seq_std",
    "m2po_masked",
    "rejected_frac",
    "collapsed",
]
ARM_KEYS = ["name", "loss", "replay", "correction", "seed", "overrides", "run_dir", "steps", "final", "eval"]
DIAGNOSTIC_NULLS = dict.fromkeys(FINAL_KEYS[8:-1])
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SAPO_BLUE, GRPO_ORANGE = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)


def has_colour(path: Path, rgb: tuple[int, int, int], min_pixels: int = 50) -> bool:
    """Whether at least ``min_pixels`` pixels of the PNG have the hue of ``rgb`` (anti-aliasing blends a thin
    line with the white background, which keeps its hue) and some saturation (grey text and grid have none)."""
    from PIL import Image

    target_hue = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[0]
    near = 0
    for count, colour in Image.open(path).convert("RGB").getcolors(maxcolors=1 << 20):
        hue, saturation, _ = colorsys.rgb_to_hsv(*(c / 255 for c in colour))
        near += count if saturation > 0.25 and abs(hue - target_hue) < 0.03 else 0
    return near >= min_pixels


def write_run(
    root: Path,
    arm: Arm,
    curves: dict[str, list],
    *,
    summary: dict | None = None,
    extra_lines: tuple[str, ...] = (),
) -> Path:
    """A run directory with one RL row per step holding ``curves`` (metric → value per step; None → null)."""
    run_dir = root / arm.name
    run_dir.mkdir(parents=True)
    steps = len(next(iter(curves.values())))
    lines = [json.dumps({"phase": "sft", "step": 10, "sft/nll": 0.5, "grad_norm": 999.0})]
    for i in range(steps):
        lines.append(json.dumps({"phase": "rl", "step": i + 1, **{k: v[i] for k, v in curves.items()}}))
    lines += extra_lines
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps({"steps": steps, **summary}))
    return run_dir


def flat(value: float, steps: int = 20) -> list[float]:
    return [value] * steps


def healthy(steps: int = 20) -> dict[str, list]:
    return {
        "reward/mean": [0.5 + 0.01 * i for i in range(steps)],
        "entropy": flat(0.8, steps),
        "mismatch/k3": flat(1e-4, steps),
        "grad_norm": flat(1.0, steps),
        "loss/total": flat(0.1, steps),
    }


SAPO = Arm("sapo", "none", "none", 0)
GRPO = Arm("grpo", "r2", "tis", 1)


def test_final_values_match_the_definitions(tmp_path):
    steps = 20
    curves = {
        "reward/mean": [(i + 1) / steps for i in range(steps)],  # last 10 % = steps 19, 20
        "entropy": [2.0 - 0.05 * i for i in range(steps)],
        "mismatch/k3": [1e-4 * (i + 1) for i in range(steps)],
        "routing/agreement_used": flat(1.0),
        "routing/agreement": [0.9 if i % 2 else 0.8 for i in range(steps)],
        "grad_norm": [1.0 + 0.1 * i for i in range(steps)],
        "loss/total": flat(0.0),
    }
    run_dir = write_run(tmp_path, SAPO, curves, summary={"accuracy_before": 0.4, "accuracy_after": 0.55})
    result = load_arm_result(SAPO, run_dir)
    final = result.final
    assert final["reward"] == pytest.approx((0.95 + 1.0) / 2)
    assert final["entropy"] == pytest.approx((2.0 - 0.9 + 2.0 - 0.95) / 2)
    assert final["mismatch_k3"] == pytest.approx(1e-4 * 10.5)
    assert final["routing_agreement"] == 1.0
    assert final["routing_agreement_live"] == pytest.approx(0.85)
    assert final["grad_norm_max"] == pytest.approx(2.9)
    assert final["accuracy"] == 0.55
    assert final["collapsed"] is False and result.reasons == []
    assert result.status == "finished" and result.completed_steps == 20


def test_a_resumed_run_counts_the_last_row_of_each_step(tmp_path):
    curves = {"reward/mean": [0.1, 0.2, 0.3], "grad_norm": [1.0, 1.0, 1.0]}
    again = json.dumps({"phase": "rl", "step": 3, "reward/mean": 0.9, "grad_norm": 1.0})
    run_dir = write_run(tmp_path, SAPO, curves, extra_lines=(again, '{"phase": "rl", "st'))  # + a torn line
    result = load_arm_result(SAPO, run_dir)
    assert result.steps == [1, 2, 3]
    assert result.final["reward"] == 0.9
    assert result.status == "unfinished" and result.completed_steps == 3


@pytest.mark.parametrize(
    ("change", "summary", "failure", "reason"),
    [
        ({}, {"accuracy_before": 0.5, "accuracy_after": 0.6}, None, None),
        ({"reward/mean": flat(0.6, 10) + flat(0.2, 10)}, None, None, "reward 0.6 → 0.2"),
        ({"reward/mean": flat(0.6, 10) + flat(0.3, 10)}, None, None, None),  # exactly half: not below
        ({"reward/mean": [0.3, 0.05, *flat(0.0, 18)]}, None, None, "reward 0.3 → 0"),  # within two steps
        ({"reward/mean": flat(0.08, 10) + flat(0.0, 10)}, None, None, None),  # started below 0.1
        ({}, {"accuracy_before": 0.8, "accuracy_after": 0.3}, None, "held-out accuracy 0.8 → 0.3"),
        ({}, {"accuracy_before": 0.8, "accuracy_after": 0.4}, None, None),
        ({}, {"accuracy_before": 0.05, "accuracy_after": 0.0}, None, None),
        ({"grad_norm": [*flat(1.0, 19), 25.0]}, None, None, "gradient norm 25 ≥ 20× median 1"),
        ({"grad_norm": [*flat(1.0, 19), 15.0]}, None, None, None),
        (
            {"grad_norm": flat(0.0, 10) + flat(0.5, 9) + [5.0]},
            None,
            None,
            None,
        ),  # zeros: no gradient, not small
        (
            {"grad_norm": [*flat(1.0, 12), None, *flat(1.0, 7)]},
            None,
            None,
            "non-finite loss or gradient norm at step 13",
        ),
        (
            {"loss/total": [*flat(0.1, 4), None, *flat(0.1, 15)]},
            None,
            None,
            "non-finite loss or gradient norm at step 5",
        ),
        (
            {},
            None,
            "3 optimizer steps in a row had a non-finite loss or gradient norm",
            "stopped on non-finite updates",
        ),
        ({}, None, "the reward server did not answer", None),
    ],
)
def test_the_collapse_rule_on_made_up_curves(tmp_path, change, summary, failure, reason):
    run_dir = write_run(tmp_path, SAPO, {**healthy(), **change}, summary=summary)
    result = load_arm_result(SAPO, run_dir, failure)
    assert result.reasons == ([reason] if reason else [])
    assert result.final["collapsed"] is bool(reason)


def test_several_reasons_are_all_named(tmp_path):
    change = {"reward/mean": flat(0.6, 10) + flat(0.1, 10), "grad_norm": [*flat(1.0, 19), 100.0]}
    run_dir = write_run(
        tmp_path, SAPO, {**healthy(), **change}, summary={"accuracy_before": 0.7, "accuracy_after": 0.1}
    )
    reasons = load_arm_result(SAPO, run_dir).reasons
    assert reasons == ["reward 0.6 → 0.1", "held-out accuracy 0.7 → 0.1", "gradient norm 100 ≥ 20× median 1"]


def test_missing_metrics_and_missing_runs_give_nulls(tmp_path):
    write_run(tmp_path, SAPO, {"reward/mean": [0.2, None, 0.4], "grad_norm": [None, None, None]})
    result = load_arm_result(SAPO, tmp_path / SAPO.name)
    assert result.final == {
        "reward": 0.4,
        "accuracy": None,
        "entropy": None,
        "mismatch_k3": None,
        "routing_agreement": None,
        "routing_agreement_live": None,
        "grad_norm_max": None,
        "reverse_kl": None,
        **DIAGNOSTIC_NULLS,
        "collapsed": True,  # a null grad_norm was logged: it was not finite
    }
    never_ran = load_arm_result(GRPO, tmp_path / "nowhere")
    assert never_ran.steps == [] and never_ran.completed_steps == 0 and never_ran.status == "unfinished"
    assert set(never_ran.final.values()) == {None, False}


def test_report_json_has_exactly_the_documented_shape(tmp_path):
    write_run(tmp_path, SAPO, healthy(), summary={"accuracy_before": 0.5, "accuracy_after": 0.6})
    write_run(tmp_path, GRPO, {**healthy(10), "reward/mean": flat(0.6, 5) + flat(0.1, 5)})
    files = write_report(tmp_path, [SAPO, GRPO], failures={GRPO.name: "killed by a test"})
    data = json.loads(files.json.read_text())
    assert list(data) == ["arms"] and len(data["arms"]) == 2
    for entry in data["arms"]:
        assert list(entry) == ARM_KEYS and list(entry["final"]) == FINAL_KEYS
    sapo, grpo = data["arms"]
    assert (sapo["loss"], sapo["replay"], sapo["correction"], sapo["seed"]) == ("sapo", "none", "none", 0)
    assert (grpo["loss"], grpo["replay"], grpo["correction"], grpo["seed"]) == ("grpo", "r2", "tis", 1)
    assert sapo["run_dir"] == str(tmp_path / SAPO.name) and (sapo["steps"], grpo["steps"]) == (20, 10)
    assert sapo["final"]["accuracy"] == 0.6 and sapo["final"]["collapsed"] is False
    assert grpo["final"]["accuracy"] is None and grpo["final"]["routing_agreement"] is None
    assert grpo["final"]["collapsed"] is True and grpo["final"]["reward"] == pytest.approx(0.1)


def test_plots_are_small_non_empty_pngs_even_for_metrics_nobody_logged(tmp_path):
    write_run(tmp_path, SAPO, healthy(), summary={"accuracy_before": 0.5, "accuracy_after": 0.6})
    write_run(tmp_path, GRPO, {**healthy(), "grad_norm": [*flat(1.0, 5), None, *flat(2.0, 14)]})
    files = write_report(tmp_path, [SAPO, GRPO])
    names = [path.name for path in files.plots]
    assert names == [
        "reward.png",
        "accuracy.png",
        "entropy.png",
        "mismatch_k3.png",
        "routing_agreement.png",  # no arm logged routing agreement: the file says so
        "grad_norm.png",
        "reverse_kl.png",  # no arm had a teacher
        "ratio_tails.png",  # nor logged the policy diagnostics
        "kl_old.png",
        "sapo_gate.png",
    ]
    for path in files.plots:
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and 1_000 < len(data) < 150_000, (path.name, len(data))
        # an arm's colour (matplotlib's C0, C1) is in the picture exactly when its curve was drawn: nobody
        # logged routing agreement or reverse KL, and GRPO has no held-out accuracy (no summary.json, no eval steps)
        nobody = (False, False)
        drawn = {"routing_agreement": nobody, "reverse_kl": nobody, "accuracy": (True, False)}
        drawn = {**drawn, **dict.fromkeys(("ratio_tails", "kl_old", "sapo_gate"), nobody)}.get(
            path.stem, (True, True)
        )
        assert (has_colour(path, SAPO_BLUE), has_colour(path, GRPO_ORANGE)) == drawn, path.name
    assert not list((tmp_path / "plots").glob(".*"))  # no temporary file left


def test_report_markdown_has_the_table_the_reading_and_the_rule(tmp_path):
    write_run(tmp_path, SAPO, healthy(), summary={"accuracy_before": 0.5, "accuracy_after": 0.6})
    write_run(tmp_path, GRPO, {**healthy(), "reward/mean": flat(0.6, 10) + flat(0.1, 10)}, summary={})
    md = write_report(tmp_path, [SAPO, GRPO], header=["2 arms, a test."]).markdown.read_text()
    assert md.startswith("# sapo-megatron compare\n\n2 arms, a test.\n")
    assert (
        "| `sapo-none-none-s0` | finished | 20 | 0.685 | 0.5 → 0.6 | 0.8 | 1.00e-04 | – / – | 1 | – | no |"
        in md
    )
    assert "| `grpo-r2-tis-s1` | finished | 20 | 0.1 | – → – |" in md
    assert "**yes**: reward 0.6 → 0.1" in md
    assert "- Collapsed: `grpo-r2-tis-s1` (reward 0.6 → 0.1)." in md
    assert "- sapo: collapsed in 0 of 1 arms (none 0/1)." in md
    assert "- grpo: collapsed in 1 of 1 arms (r2 1/1)." in md
    assert "- Highest held-out accuracy after RL: 0.6 (`sapo-none-none-s0`)." in md
    assert "- Arms with routing replay that logged no `routing/agreement_used`" in md
    assert COLLAPSE_RULE in md
    assert "![routing_agreement](plots/routing_agreement.png)" in md


def test_no_mismatch_and_failures_are_said(tmp_path):
    write_run(tmp_path, SAPO, {**healthy(), "mismatch/k3": flat(0.0)}, summary={"accuracy_after": 0.2})
    md = write_report(tmp_path, [SAPO, GRPO], failures={GRPO.name: "exit status 1"}).markdown.read_text()
    assert "- Mismatch k3 is below 1e-06 in every arm: the engine and the trainer agree" in md
    assert "- Not finished: `grpo-r2-tis-s1` (failed: exit status 1)." in md
    assert "| `grpo-r2-tis-s1` | failed | 0 | – | – → – |" in md


def test_the_seeds_of_one_configuration_are_one_curve_their_mean_with_gaps_where_none_logged(tmp_path):
    from dataclasses import replace

    from sapo_megatron.compare.plots import _values_per_step
    from sapo_megatron.compare.report import by_configuration

    seeds = [SAPO, replace(SAPO, seed=1), replace(SAPO, seed=2)]
    rewards = [flat(0.2, 4), [0.4, None, 0.4, 0.4], [0.9, None, 0.3, None]]
    for arm, reward in zip(seeds, rewards):
        write_run(tmp_path, arm, {**healthy(4), "reward/mean": reward})
    write_run(tmp_path, GRPO, healthy(4))
    results = [load_arm_result(arm, tmp_path / arm.name) for arm in [*seeds, GRPO]]
    groups = by_configuration(results)
    assert list(groups) == ["sapo-none-none", "grpo-r2-tis"]
    assert [r.arm.seed for r in groups["sapo-none-none"]] == [0, 1, 2]
    steps, per_step = _values_per_step(groups["sapo-none-none"], "reward")
    assert steps == [1, 2, 3, 4]
    assert per_step == [[0.2, 0.4, 0.9], [0.2], [0.2, 0.4, 0.3], [0.2, 0.4]]
    assert _values_per_step(groups["sapo-none-none"], "routing_agreement") == ([], [])
    # the picture draws both configurations (SAPO blue, GRPO orange)
    files = write_report(tmp_path, [*seeds, GRPO])
    reward_png = next(path for path in files.plots if path.name == "reward.png")
    assert has_colour(reward_png, SAPO_BLUE) and has_colour(reward_png, GRPO_ORANGE)


def eval_row(step: int, heldout: float, sampled: float, sampled_pass: float) -> str:
    """An eval row as the trainer writes it: per dataset and per source (``eval/<name>/<source>/...``)."""
    return json.dumps(
        {
            "phase": "eval",
            "step": step,
            "eval/heldout/avg@1": heldout,
            "eval/heldout/pass@1": heldout,
            "eval/heldout/addition/avg@1": 0.0,  # a source's value, not the dataset's
            "eval/sampled/avg@8": sampled,
            "eval/sampled/pass@1": sampled,
            "eval/sampled/pass@8": sampled_pass,
            "eval/sampled/maj@8": 0.0,
            "eval/sampled/addition/pass@16": 1.0,
        }
    )


def test_diagnostics_eval_datasets_and_the_table_by_configuration(tmp_path):
    from dataclasses import replace

    diagnostics = {
        "ratio/p99.9": [1.1, 1.3, 1.2, 1.4],
        "ratio/max": [1.5, 9.0, 2.0, 3.0],
        "policy/kl_old": [0.0, 0.002, 0.004, 0.006],
        "clip/frac": [0.0, 0.1, 0.2, 0.1],
    }
    gate = {
        "sapo/w_mean_pos": [1.0, 0.9, 0.8, 0.7],
        "sapo/w_mean_neg": flat(0.5, 4),
        "sapo/seq_w_std": flat(0.1, 4),
    }
    seeds = [SAPO, replace(SAPO, seed=1)]
    evals = [
        # before, at step 2, after; seed 0 resumed at step 4 and evaluated it again (the last row counts)
        (
            eval_row(0, 0.4, 0.3, 0.6),
            eval_row(2, 0.5, 0.35, 0.7),
            eval_row(4, 0.1, 0.1, 0.1),
            eval_row(4, 0.6, 0.4, 0.8),
        ),
        (eval_row(0, 0.4, 0.3, 0.6), eval_row(4, 0.4, 0.2, 0.6)),
    ]
    for arm, rows in zip(seeds, evals):
        write_run(tmp_path, arm, {**healthy(4), **diagnostics, **gate}, summary={}, extra_lines=rows)
    write_run(tmp_path, GRPO, {**healthy(4), **diagnostics}, summary={})
    result = load_arm_result(SAPO, tmp_path / SAPO.name)
    assert result.final["ratio_p99_9"] == pytest.approx(1.25) and result.final["ratio_max"] == 9.0
    assert result.final["kl_old"] == pytest.approx(0.003) and result.final["clip_frac"] == pytest.approx(0.1)
    assert result.final["gate_w_pos"] == pytest.approx(0.85) and result.final[
        "gate_seq_std"
    ] == pytest.approx(0.1)
    sampled = result.evals["sampled"]
    assert (sampled.metric, sampled.pass_metric, sampled.steps) == ("avg@8", "pass@8", (0, 2, 4))
    assert sampled.values == (0.3, 0.35, 0.4) and sampled.pass_values == (0.6, 0.7, 0.8)
    assert result.evals["heldout"].summary() == {
        "metric": "avg@1",
        "before": 0.4,
        "after": 0.6,
        "pass_metric": "pass@1",
        "pass_after": 0.6,
    }
    assert load_arm_result(GRPO, tmp_path / GRPO.name).evals == {}

    files = write_report(tmp_path, [*seeds, GRPO])
    data = json.loads(files.json.read_text())
    assert data["arms"][1]["eval"]["sampled"] == {
        "metric": "avg@8",
        "before": 0.3,
        "after": 0.2,
        "pass_metric": "pass@8",
        "pass_after": 0.6,
    }
    assert data["arms"][2]["eval"] == {} and data["arms"][2]["final"]["gate_w_pos"] is None
    md = files.markdown.read_text()
    head = (
        "| configuration | seeds | collapsed | reward | heldout avg@1 | sampled avg@8 | sampled pass@8 | entropy | "
        "ratio p99.9 | ratio max | kl_old | clip frac | gate w+ / w− | gate std in seq |"
    )
    assert head in md  # no pass@1 column for greedy heldout, no reverse KL column (no teacher)
    # two seeds: mean ± standard deviation; heldout after 0.6 and 0.4, sampled pass@8 0.8 and 0.6
    assert (
        "| `sapo-none-none` | 2/2 | 0 | 0.5 ± 0 → 0.53 ± 0 | 0.4 → 0.5 ± 0.141 | 0.3 → 0.3 ± 0.141 | "
        "0.7 ± 0.141 | 0.8 ± 0 | 1.25 ± 0 | 9 | 0.003 ± 0 | 0.1 ± 0 | 0.85 ± 0 / 0.5 ± 0 | 0.1 ± 0 |" in md
    )
    assert "| `grpo-r2-tis` | 1/1 | 0 | 0.5 → 0.53 | – | – | – | 0.8 | 1.25 | 9 | 0.003 | 0.1 | – | – |" in md
    assert {"eval_heldout.png", "eval_sampled.png"} <= {path.name for path in files.plots}
    sampled_png = tmp_path / "plots" / "eval_sampled.png"
    assert has_colour(sampled_png, SAPO_BLUE) and not has_colour(sampled_png, GRPO_ORANGE)


def test_a_dataset_of_several_sources_reports_each_sources_avg(tmp_path):
    """Mixed tasks: the table, report.json and the plots carry each source's avg@n beside the dataset's."""

    def row(step: int, colour: float, logic: float) -> str:
        return json.dumps(
            {
                "phase": "eval",
                "step": step,
                "eval/heldout/avg@4": (colour + logic) / 2,
                "eval/heldout/pass@4": 1.0,
                "eval/heldout/name_colour/avg@4": colour,
                "eval/heldout/name_colour/pass@4": 1.0,
                "eval/heldout/knights_knaves/avg@4": logic,
            }
        )

    write_run(tmp_path, SAPO, healthy(4), summary={}, extra_lines=(row(0, 0.2, 0.0), row(4, 0.6, 0.1)))
    result = load_arm_result(SAPO, tmp_path / SAPO.name)
    assert list(result.evals) == ["heldout", "heldout/knights_knaves", "heldout/name_colour"]
    colour = result.evals["heldout/name_colour"]
    assert (colour.metric, colour.pass_metric, colour.steps, colour.values) == (
        "avg@4",
        None,
        (0, 4),
        (0.2, 0.6),
    )
    assert result.evals["heldout"].values == (0.1, 0.35)
    files = write_report(tmp_path, [SAPO])
    arm = json.loads(files.json.read_text())["arms"][0]
    assert arm["eval"]["heldout/knights_knaves"]["before"] == 0.0
    assert arm["eval"]["heldout/knights_knaves"]["after"] == 0.1
    md = files.markdown.read_text()
    assert (
        "| heldout avg@4 | heldout pass@4 | heldout/knights_knaves avg@4 | heldout/name_colour avg@4 |" in md
    )
    assert "| 0.1 → 0.35 | 1 | 0 → 0.1 | 0.2 → 0.6 |" in md
    assert {"eval_heldout_name_colour.png", "eval_heldout_knights_knaves.png"} <= {
        p.name for p in files.plots
    }


def test_the_baselines_masking_diagnostics_are_step_means(tmp_path):
    m2po = Arm("m2po", "none", "geo_rs", 0)
    curves = {
        **healthy(4),
        "m2po/frac_masked": [0.0, 0.1, 0.2, 0.3],
        "rollout_corr/rejected_frac": flat(0.05, 4),
    }
    write_run(tmp_path, m2po, curves, summary={})
    final = load_arm_result(m2po, tmp_path / m2po.name).final
    assert final["m2po_masked"] == pytest.approx(0.15) and final["rejected_frac"] == pytest.approx(0.05)
    write_run(tmp_path, SAPO, healthy(4), summary={})
    assert load_arm_result(SAPO, tmp_path / SAPO.name).final["m2po_masked"] is None
