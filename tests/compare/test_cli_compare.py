"""``sapo-megatron compare`` on the command line: help with defaults, and bad input refused in one line (exit 2)
before anything is written."""

from __future__ import annotations

import pytest

from sapo_megatron.cli import build_parser, main
from tests.test_cli import option_blocks, subparser


def test_compare_options_have_help_with_their_defaults():
    compare = subparser("compare")
    blocks = option_blocks(compare.format_help())
    assert "(default: sapo,gspo,grpo)" in blocks["--losses"]
    assert "(default: none,r2,r3)" in blocks["--replay"]
    assert "(default: none)" in blocks["--corrections"]
    assert "(default: 1)" in blocks["--seeds"]
    for option in ("--steps", "--output-dir", "--overwrite", "--set", "--debug", "--slurm", "--sbatch"):
        assert subparser("compare").format_help().count(option) >= 2, option  # usage and its help
    args = build_parser().parse_args(["compare", "--steps", "3", "--output-dir", "d"])
    assert (args.config, args.losses, args.replay, args.seeds, args.set) == (
        None,
        "sapo,gspo,grpo",
        "none,r2,r3",
        1,
        [],
    )


def test_steps_and_output_dir_are_required(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["compare", "--steps", "2"])
    assert exit_info.value.code == 2
    assert "the following arguments are required: --output-dir" in capsys.readouterr().err
    # --steps is optional on the command line (--runs trains nothing) and required for a comparison that trains
    assert main(["compare", "--output-dir", "d"]) == 2  # a CompareError
    assert "--steps is required (RL steps of every arm), unless --runs" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--losses", "sapo,ppo"],
            "--losses: unknown name 'ppo' (did you mean 'dppo_tv'?); choose from sapo, gspo, grpo, cispo, gmpo, dppo_tv, dppo_kl, m2po",
        ),
        (
            ["--replay", "none,r33"],
            "--replay: unknown name 'r33' (did you mean 'r3'?); choose from none, r2, r3",
        ),
        (["--corrections", "tis,tis"], "--corrections: tis given more than once"),
        (
            ["--configurations", "sapo-none-none", "--replay", "none"],
            "--configurations names every arm's loss, replay and correction; drop --replay",
        ),
        (["--configurations", "sapo-none"], "--configurations 'sapo-none': expected LOSS-REPLAY-CORRECTION"),
        (["--steps", "0"], "--steps 0: each arm needs at least one RL step"),
        (["--seeds", "0"], "--seeds 0: need at least one seed"),
        (["--set", "seed=3"], "--set seed: every arm gets its own"),
        (["--sbatch=--partition=gpu"], "--sbatch goes with --slurm (options of the jobs it submits)"),
        (
            ["--slurm", "--sbatch=--time=1:00 gpu"],
            "--sbatch '--time=1:00 gpu': 'gpu' is not an sbatch option",
        ),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, capsys, extra, message):
    out = tmp_path / "cmp"
    argv = ["compare", "--steps", "3", "--output-dir", str(out), "--set", "sft.steps=20", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sapo-megatron: {message}"), err
    assert "Traceback" not in err
    assert not out.exists()


def test_slurm_without_sbatch_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch there
    out = tmp_path / "cmp"
    assert main(["compare", "--slurm", "--steps", "3", "--output-dir", str(out)]) == 2
    assert capsys.readouterr().err.startswith("sapo-megatron: --slurm: sbatch / squeue not found on PATH")
    assert not out.exists()
