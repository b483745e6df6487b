"""``sapo-megatron`` command line: train (the RL loop; with no config, the embedded tiny demo), compare (losses ×
routing replay × corrections, with a report), plan (memory per GPU and a fits verdict), convert, serve, eval (a
model on eval datasets: avg@n, pass@k, maj@n) and report (a run's plots; also written at the end of train).

Errors a user can act on (:class:`~sapo_megatron.errors.UserError`: config, data, checkpoint, run directory, ...)
print ``sapo-megatron: <message>`` and a ``hint:`` line, without a traceback unless ``--debug`` (``train.log``
in the run directory has it either way), and exit with the error's code; an interrupted run prints one line
saying how to resume and exits 130. Other exceptions are bugs: they keep their traceback. Under several ranks
only rank 0 prints; the others exit with the same code.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from sapo_megatron import __version__
from sapo_megatron.errors import RunInterrupted, UserError
from sapo_megatron.runtime import logs
from sapo_megatron.runtime.interrupts import EXIT_NOW_CODE
from sapo_megatron.runtime.local_launch import note_failure

if TYPE_CHECKING:
    from sapo_megatron.config import RunConfig

# Imports of this module stay light (no torch, pydantic or Megatron): `--help`, `--version` and every refusal
# answer before they are loaded; each command imports what it needs inside its function
# (tests/test_cli_startup.py checks; bench/bench_cli_startup.py measures).

DESCRIPTION = """\
sapo-megatron: RL post-training of Mixture-of-Experts models on Megatron-Core.

Commands: train (the RL loop; without CONFIG the embedded tiny demo), eval (avg@n, pass@k, maj@n of a model),
report (a run's plots), compare (losses x routing replays x corrections, with a report), plan (memory per GPU
and a fits verdict), convert (HF <-> Megatron), serve (the CPU rollout server).

An error you can fix (config, data, checkpoint, output directory) prints one line and a hint; --debug shows
its traceback, which train.log in the run directory keeps either way. --verbose shows Megatron's own log."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(_normalise_resume(argv))
    args.argv = argv
    debug = bool(getattr(args, "debug", False))
    verbose = bool(getattr(args, "verbose", False))
    is_main = os.environ.get("RANK", "0") == "0"
    with logs.console(is_main=is_main, debug=debug, verbose=verbose):
        logs.filter_known_warnings()
        code = _run(args, argv, is_main=is_main, debug=debug)
    if code:
        note_failure()  # for a local launcher: this rank's failure time, before teardown makes its peers fail
    return code


def _run(args: argparse.Namespace, argv: list[str], *, is_main: bool, debug: bool) -> int:
    """The command's handler; an error becomes its exit status, reported as the module docstring says."""
    try:
        return int(args.handler(args) or 0)
    except UserError as err:
        return _report_user_error(err, argv, is_main=is_main, debug=debug)
    except KeyboardInterrupt as err:  # a signal before (or without) the trainer's interrupt guard
        logs.record_exception(err)
        if is_main:
            print("sapo-megatron: interrupted", file=sys.stderr)
        return EXIT_NOW_CODE
    except Exception as err:
        return _report_crash(err, is_main=is_main, debug=debug)
    except SystemExit as err:  # raised inside the command by code it ran (a reward, tool, episode function)
        return _report_exit(err, is_main=is_main)


def _report_exit(err: SystemExit, *, is_main: bool) -> int:
    """A ``SystemExit`` that escaped a command's handler did not come from the command itself (its handlers
    return their status): the command did not finish, so it never exits 0 for it."""
    logs.record_exception(err)
    if is_main:
        print(
            f"sapo-megatron: the command did not finish: SystemExit({err.code!r}) was raised inside it (by user "
            "code it ran: a reward, tool or episode function?); see train.log for where",
            file=sys.stderr,
        )
    return err.code if isinstance(err.code, int) and err.code not in (0,) else 1


PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "Socket closed",
)
"""What gloo / NCCL / the TCP store say on a rank whose peer (rank 0, after its clear error) has exited."""


def _report_crash(err: Exception, *, is_main: bool, debug: bool = False) -> int:
    """A bug: its whole traceback (console and train.log). Except on a rank other than 0 whose collective failed
    because a peer exited: rank 0 printed why, and a second rank's 40-line gloo traceback must not end up last
    on the screen; one line says what happened (the traceback stays in train.log and with --debug)."""
    if not is_main and not debug and any(words in str(err) for words in PEER_GONE):
        logs.record_exception(err)
        rank = os.environ.get("RANK", "?")
        print(
            f"sapo-megatron: rank {rank} stops: another rank ended the run (its error is above)",
            file=sys.stderr,
        )
        return 1
    traceback.print_exception(type(err), err, err.__traceback__)
    return 1


def _report_user_error(err: UserError, argv: list[str], *, is_main: bool, debug: bool) -> int:
    if not is_main:
        return err.exit_code
    if debug:
        traceback.print_exception(type(err), err, err.__traceback__)
    else:
        logs.record_exception(err)
    if isinstance(err, RunInterrupted):
        print(f"sapo-megatron: {err}; resume with: {resume_command(argv)}", file=sys.stderr)
        return err.exit_code
    config = sys.modules.get("sapo_megatron.config")  # not imported: not a ConfigError (keeps errors light)
    kind = "configuration error: " if config and isinstance(err, config.ConfigError) else ""
    print(f"sapo-megatron: {kind}{err}", file=sys.stderr)
    if err.hint:
        print(f"hint: {err.hint}", file=sys.stderr)
    return err.exit_code


def resume_command(argv: list[str]) -> str:
    """The command that continues the run ``argv`` started: the same arguments with ``--resume``."""
    kept, skip_value = [], False
    for arg in _normalise_resume(argv):
        if skip_value:
            skip_value = False
            if arg == "auto":
                continue
        if arg == "--overwrite" or arg.startswith("--resume="):
            continue
        if arg == "--resume":
            skip_value = True
            continue
        kept.append(arg)
    return shlex.join(["sapo-megatron", *kept, "--resume"])


def _normalise_resume(argv: list[str]) -> list[str]:
    """``--resume`` takes an optional ``auto``; make a bare ``--resume`` explicit so that argparse does not take
    a following config path for its value (``train --resume run.yaml``)."""
    out = []
    for i, arg in enumerate(argv):
        following = argv[i + 1] if i + 1 < len(argv) else None
        out.append("--resume=yes" if arg == "--resume" and following != "auto" else arg)
    return out


# --------------------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """A usage error is one line and a hint, as every other error of the command line (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        print(f"hint: {self.prog} --help lists the options", file=sys.stderr)
        sys.exit(2)


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help (unless the help already names it, or there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not _shows_default(action) or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sapo-megatron", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"sapo-megatron {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train_parser(commands)
    _add_compare_parser(commands)
    _add_plan_parser(commands)
    _add_serve_parser(commands)
    _add_convert_parser(commands)
    _add_eval_parsers(commands)
    _apply_formatter(parser)
    parser.formatter_class = _RawDescriptionFormatter  # DESCRIPTION keeps its line breaks
    return parser


def _apply_formatter(parser: argparse.ArgumentParser) -> None:
    """Every (sub)parser shows defaults; an option without help text still gets ``(default: X)``."""
    parser.formatter_class = _HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _apply_formatter(sub)
        elif not action.help and _shows_default(action):
            action.help = "(default: %(default)s)"


class _RawDescriptionFormatter(argparse.RawDescriptionHelpFormatter, _HelpFormatter):
    """The top-level help: its description keeps its lines; options show their defaults."""


def _shows_default(action: argparse.Action) -> bool:
    """An option whose default is worth printing (not a flag, not "nothing")."""
    default = action.default
    nothing = default is None or default is False or default is argparse.SUPPRESS or default == []
    return not nothing and action.nargs != 0


def _add_train_parser(commands) -> None:
    train = commands.add_parser(
        "train",
        help="run a training job (the embedded tiny demo without CONFIG)",
        description="Run a training job: optional SFT warm start, RL, HF export. Without CONFIG, the embedded "
        "tiny demo. A directory that holds a run is refused unless --resume or --overwrite says what to do.",
    )
    train.add_argument("config", nargs="?", help="YAML run config (default: the embedded demo)")
    train.add_argument("--output-dir", help="where the run writes (default: output_dir of the config)")
    train.add_argument(
        "--resume",
        nargs="?",
        choices=("yes", "auto"),
        metavar="auto",
        help="continue from the newest checkpoint in the output directory; '--resume auto' continues when "
        "there is one and starts fresh otherwise (for requeued jobs) (default: start a new run)",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run in the output directory first (only what a run writes: train.log and other "
        "files stay)",
    )
    train.add_argument(
        "--dry-run", action="store_true", help="validate and print the resolved layout, then stop"
    )
    train.add_argument("--force", action="store_true", help="train even if the planner says it does not fit")
    train.add_argument(
        "--world-size",
        type=int,
        help="world size to check the layout against (dry run; default: launch.nodes × launch.procs_per_node)",
    )
    _add_plan_options(train, prefix="dry run: ")
    train.add_argument(
        "--launch-info",
        action="store_true",
        help="print 'nodes=N procs_per_node=P world_size=W' of the resolved config and stop",
    )
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (YAML value); repeatable (default: none)",
    )
    train.add_argument("--debug", action="store_true", help="show the traceback of errors")
    train.add_argument(
        "--verbose",
        action="store_true",
        help="show Megatron's INFO log on the console and keep it in train.log",
    )
    train.set_defaults(handler=_train)


COMPARE_DEFAULTS = {"losses": "sapo,gspo,grpo", "replay": "none,r2,r3", "corrections": "none"}
CORRECTION_NAMES = ("none", "tis", "icepop", "token_is", "seq_is", "geo_rs")
"""The keys of :data:`sapo_megatron.compare.CORRECTIONS`, for the help (importing compare loads the config)."""


def _add_compare_parser(commands) -> None:
    compare = commands.add_parser(
        "compare",
        help="run the same RL job under several losses / routing replays / corrections and write a report",
        description="Run one arm per (loss, replay, correction, seed), each a normal run directory under "
        "--output-dir started from one shared SFT warm start, then write report.md, report.json and plots/. "
        "Without CONFIG: the embedded tiny MoE demo with an fp8 rollout (a training-inference mismatch "
        "source). Running the same command again skips finished arms and resumes the others.",
    )
    compare.add_argument(
        "config", nargs="?", help="YAML run config every arm shares (default: the embedded demo)"
    )
    compare.add_argument(
        "--arms",
        help="comma-separated YAML run configs, one arm each (named after the file), instead of CONFIG × "
        "--losses × --replay × --corrections; e.g. the distillation arms of configs/distill/",
    )
    compare.add_argument(
        "--runs",
        help="comma-separated run directories that already finished: write their report (table, plots, reading) "
        "into --output-dir without training anything; --steps is not needed",
    )
    compare.add_argument(
        "--teachers",
        help="with --arms: comma-separated teacher run configs, trained first into OUTPUT_DIR/teachers/<name>; "
        "each arm's teacher of that name scores with its HF export",
    )
    compare.add_argument(
        "--losses",
        default=COMPARE_DEFAULTS["losses"],
        help="comma-separated policy losses, each with its paper settings: sapo (tau 1.0/1.05), gspo "
        "(eps 3e-4/4e-4), grpo (DAPO eps 0.2/0.28, token-mean), cispo (weight cap 5), gmpo (log clip 0.4), "
        "dppo_tv (TV 0.15), dppo_kl (KL 0.05), m2po (M2 0.04); docs/compare.md",
    )
    compare.add_argument(
        "--replay",
        default=COMPARE_DEFAULTS["replay"],
        help="comma-separated MoE routing replay modes: none (live routing), r2 (the trainer's own routes of the "
        "old-log-prob pass), r3 (the rollout engine's routes); r2 and r3 need a MoE model",
    )
    compare.add_argument(
        "--corrections",
        default=COMPARE_DEFAULTS["corrections"],
        help=f"comma-separated mismatch corrections from {', '.join(CORRECTION_NAMES)} (tis: cap 2.0; "
        "token_is / seq_is / geo_rs: verl's rollout-correction presets, docs/losses.md)",
    )
    compare.add_argument(
        "--configurations",
        help="comma-separated LOSS-REPLAY-CORRECTION arms (e.g. sapo-none-none,grpo-r2-tis) instead of the "
        "product of --losses, --replay and --corrections",
    )
    compare.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="a sweep axis: one arm per value (YAML) of the config field KEY, crossed with the other axes, e.g. "
        "--grid algorithm.loss.tau_pos=1,4,16; linked keys KEY1+KEY2=A1:B1,A2:B2 move together; repeatable "
        "(Cartesian product); report.json arms carry 'overrides'",
    )
    compare.add_argument("--seeds", type=int, default=1, help="seeds per configuration: 0 .. N-1")
    compare.add_argument("--steps", type=int, help="RL steps of every arm (required unless --runs)")
    compare.add_argument(
        "--output-dir", required=True, help="where the warm start, the arms and the report go"
    )
    compare.add_argument(
        "--overwrite",
        action="store_true",
        help="delete what an earlier compare wrote into the output directory and start over",
    )
    compare.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field of every run (YAML value); repeatable (default: none)",
    )
    compare.add_argument(
        "--slurm",
        action="store_true",
        help="submit the runs to Slurm (one array job per stage) instead of running them here; the output "
        "directory must be on a filesystem the nodes share",
    )
    compare.add_argument(
        "--sbatch",
        metavar="OPTIONS",
        help='sbatch options of every --slurm job, with "=": --sbatch="--partition=gpu --gpus-per-node=8"',
    )
    compare.add_argument("--debug", action="store_true", help="show the traceback of errors (also the arms')")
    compare.set_defaults(handler=_compare)


def _add_plan_parser(commands) -> None:
    plan = commands.add_parser(
        "plan",
        help="memory per GPU (weights, gradients, optimizer, activations, colocated rollout) and a fits verdict",
        description="Plan a layout without a GPU or Transformer Engine: per pipeline stage, static memory and "
        "activations of the largest micro-batch against the GPU's memory, with a fits / does-not-fit verdict "
        "(exit 0 / 1); --suggest lists the layouts that fit, best first. docs/planning.md has the formula.",
    )
    plan.add_argument("config", nargs="?", help="YAML run config (default: the embedded demo)")
    plan.add_argument(
        "--world-size", type=int, help="GPUs to plan for (default: launch.nodes × launch.procs_per_node)"
    )
    plan.add_argument(
        "--json", action="store_true", help="print the plan as JSON (schema in docs/planning.md)"
    )
    plan.add_argument(
        "--suggest",
        type=int,
        nargs="?",
        const=5,
        metavar="N",
        help="also list the N best layouts that fit (default N: 5)",
    )
    _add_plan_options(plan)
    plan.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (YAML value); repeatable (default: none)",
    )
    plan.add_argument("--debug", action="store_true", help="show the traceback of errors")
    plan.set_defaults(handler=_plan, output_dir=None)


def _add_plan_options(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    parser.add_argument(
        "--gpu-memory-gb",
        type=float,
        help=prefix + "GPU memory in GiB as CUDA reports it (default: launch.gpu_type's, else 80)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=512,
        help=prefix + "prompt length of the padded micro-batch (responses: rollout.max_new_tokens)",
    )
    parser.add_argument(
        "--rollout-mem-fraction",
        type=float,
        help=prefix + "share of each GPU the colocated SGLang engine keeps (its --mem-fraction-static; "
        "needs rollout.colocation split or time_shared) (default: 0.5 when colocated)",
    )
    parser.add_argument(
        "--spec",
        choices=("te", "local"),
        default="te",
        help=prefix + "layer spec whose activations are counted: te (GPU clusters) or local (pure torch)",
    )
    parser.add_argument(
        "--image-patches",
        type=int,
        default=0,
        help=prefix + "vision-language models: ViT patches per micro-batch whose activations are counted "
        "(an image of H×W pixels has H·W/patch² of them; default 0: text only)",
    )


def _add_serve_parser(commands) -> None:
    from sapo_megatron.rollout.cpu.flags import add_serve_arguments

    serve = commands.add_parser(
        "serve",
        help="serve an HF model with the CPU rollout engine (SGLang's HTTP API and flag names)",
        description="A stand-in for 'python -m sglang.launch_server' on machines without GPUs: the same HTTP API "
        "subset and the same flag names, so SLURM scripts can swap one for the other.",
    )
    add_serve_arguments(serve)
    serve.set_defaults(handler=_serve)


def _add_eval_parsers(commands) -> None:
    from sapo_megatron.eval.cli import add_eval_parser, add_report_parser

    add_eval_parser(commands)
    add_report_parser(commands)


def _add_convert_parser(commands) -> None:
    from sapo_megatron.conversion.cli import add_convert_parser

    add_convert_parser(commands)


# --------------------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------------------


def resolve_config(
    args: argparse.Namespace, *, world_size: int | None = None, check_layout: bool = True
) -> RunConfig:
    from sapo_megatron.config import load_config, parse_overrides

    overrides = parse_overrides(args.set)
    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    return load_config(args.config, overrides, world_size=world_size, check_layout=check_layout)


def run_mode(args: argparse.Namespace) -> str:
    """``new``, ``resume``, ``auto`` or ``overwrite`` (see :mod:`sapo_megatron.runtime.run_dir`)."""
    if args.resume and args.overwrite:
        raise UserError(
            "--resume and --overwrite contradict each other",
            hint="--resume continues the run in the output directory, --overwrite deletes it",
        )
    if args.overwrite:
        return "overwrite"
    return {None: "new", "yes": "resume", "auto": "auto"}[args.resume]


def _train(args: argparse.Namespace) -> int:
    from sapo_megatron.loop.preflight import check_training_precision, preflight
    from sapo_megatron.plan.gate import check_layout_fits
    from sapo_megatron.runtime.run_dir import check_run_dir

    cfg = resolve_config(args, world_size=args.world_size if args.dry_run else None)
    if args.launch_info:
        launch = cfg.launch
        print(f"nodes={launch.nodes} procs_per_node={launch.procs_per_node} world_size={launch.world_size}")
        return 0
    if args.dry_run:
        return _dry_run(cfg, args)
    mode = run_mode(args)
    preflight(cfg)  # before any process starts; each rank's session runs it again, the dry run too
    if "WORLD_SIZE" not in os.environ:  # the command the user typed (not a rank it started): before torch
        check_run_dir(cfg.output_dir, mode=mode)
    check_training_precision(cfg)
    check_layout_fits(cfg, force=args.force)  # the planner's verdict (runs that name launch.gpu_type)
    if cfg.launch.world_size > 1 and "WORLD_SIZE" not in os.environ:
        return _launch_ranks(cfg, args.argv)
    _run_training(cfg, mode)
    return 0


def _run_training(cfg: RunConfig, mode: str) -> None:
    from sapo_megatron.eval.report import report_after_training
    from sapo_megatron.loop import trainer
    from sapo_megatron.runtime.wandb_tracking import upload_report

    trainer.run(cfg, mode=mode)
    if os.environ.get("RANK", "0") == "0":
        print(report_after_training(cfg.output_dir))
        upload_report(cfg, Path(cfg.output_dir), sorted((Path(cfg.output_dir) / "report").glob("*.png")))


def _dry_run(cfg: RunConfig, args: argparse.Namespace) -> int:
    """Validate the layout for ``--world-size`` (else ``launch.*``), print the plan, run the start-up checks
    (:func:`~sapo_megatron.loop.preflight.preflight`, as ``train`` does) and check every row of the data. Exits
    1 when the planner's verdict is does-not-fit (like ``plan``)."""
    from sapo_megatron.config import ConfigError, validate_layout
    from sapo_megatron.loop.evaluation import describe_training_suite
    from sapo_megatron.loop.preflight import check_run_data, preflight
    from sapo_megatron.plan import build_plan, format_plan
    from sapo_megatron.plan.cli import plan_settings
    from sapo_megatron.plan.gate import unfit_summary

    world = args.world_size or cfg.launch.world_size
    validate_layout(cfg, world)
    print(f"layout OK: {cfg.name} -> {cfg.output_dir}")
    plan = build_plan(cfg, plan_settings(cfg, args, world))
    print(format_plan(plan))
    try:
        preflight(cfg)
    except ConfigError as err:
        err.hint = "the layout above is valid; what these checks read must exist where the job runs"
        raise
    print("inputs OK: every input file exists, the reward and the trackers load")
    # every row's schema, the prompt lengths (with the tools the prompts show); prints counts and times
    data = check_run_data(cfg, verbose=True)
    from sapo_megatron.loop.learning_signal import dry_run_warm_start

    print("\n".join(dry_run_warm_start(cfg, data)))  # train's checks of the warm start's targets

    print("\n".join(describe_training_suite(cfg, data.tokenizer)))  # the eval datasets, read and checked
    print("data OK: every row of the prompt data is usable")
    if not plan.fits:
        print(f"error: the layout does not fit: {unfit_summary(plan)} (exit 1)", file=sys.stderr)
        return 1
    return 0


def _plan(args: argparse.Namespace) -> int:
    from sapo_megatron.plan.cli import run_plan

    return run_plan(resolve_config(args, world_size=args.world_size, check_layout=not args.suggest), args)


def _launch_ranks(cfg: RunConfig, argv: list[str]) -> int:
    """Start ``procs_per_node`` local ranks of this same command (multi-node jobs start under SLURM, see
    launch/); see :mod:`sapo_megatron.runtime.local_launch` for why not torchrun."""
    from sapo_megatron.errors import ConfigError

    if cfg.launch.nodes > 1:
        raise ConfigError(
            f"launch.nodes={cfg.launch.nodes}: multi-node jobs start through launch/slurm_train.sbatch, not directly"
        )
    from sapo_megatron.runtime.local_launch import launch_local

    command = [sys.executable, "-m", "sapo_megatron.cli", *argv]
    return launch_local(command, cfg.launch.procs_per_node)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for local rendezvous and test servers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _compare(args: argparse.Namespace) -> int:
    from sapo_megatron.compare import (
        CORRECTIONS,
        LOSSES,
        REPLAYS,
        CompareError,
        build_config_plan,
        build_plan,
        parse_configurations,
        parse_grid,
        parse_names,
        run_compare,
    )
    from sapo_megatron.config import parse_overrides

    if args.runs:
        return _compare_finished(args)
    if args.steps is None:
        raise CompareError("--steps is required (RL steps of every arm), unless --runs reports finished runs")
    grid = parse_grid(args.grid)
    changed = [f"--{k}" for k, v in COMPARE_DEFAULTS.items() if getattr(args, k) != v]
    if args.arms:
        given = ["CONFIG"] * bool(args.config) + changed + ["--configurations"] * bool(args.configurations)
        if given:
            raise CompareError(f"--arms names every arm's whole config; drop {', '.join(given)}")
        plan = build_config_plan(
            [p.strip() for p in args.arms.split(",") if p.strip()],
            parse_overrides(args.set),
            teacher_configs=[p.strip() for p in (args.teachers or "").split(",") if p.strip()],
            seeds=args.seeds,
            steps=args.steps,
            output_dir=args.output_dir,
            grid=grid,
        )
    else:
        if args.teachers:
            raise CompareError("--teachers goes with --arms (configs whose teachers it trains)")
        plan = build_plan(
            args.config,
            parse_overrides(args.set),
            losses=parse_names(args.losses, list(LOSSES), "--losses"),
            replays=parse_names(args.replay, list(REPLAYS), "--replay"),
            corrections=parse_names(args.corrections, list(CORRECTIONS), "--corrections"),
            seeds=args.seeds,
            steps=args.steps,
            output_dir=args.output_dir,
            grid=grid,
            configurations=parse_configurations(args.configurations, changed)
            if args.configurations
            else None,
        )
    if args.slurm:
        from sapo_megatron.compare.slurm import run_compare_slurm, sbatch_options

        outcome = run_compare_slurm(
            plan, overwrite=args.overwrite, debug=args.debug, sbatch_options=sbatch_options(args.sbatch)
        )
    elif args.sbatch:
        raise CompareError("--sbatch goes with --slurm (options of the jobs it submits)")
    else:
        outcome = run_compare(plan, overwrite=args.overwrite, debug=args.debug)
    return 1 if outcome.failures else 0


def _compare_finished(args: argparse.Namespace) -> int:
    from sapo_megatron.compare import CompareError
    from sapo_megatron.compare.finished import report_finished_runs

    given = [
        flag
        for flag, value in (("CONFIG", args.config), ("--arms", args.arms), ("--grid", args.grid))
        if value
    ]
    if given:
        raise CompareError(f"--runs reports finished runs as they are; drop {', '.join(given)}")
    from sapo_megatron.runtime.run_dir import check_command_output_dir

    check_command_output_dir(args.output_dir, command="compare", overwrite=args.overwrite)
    files = report_finished_runs([p.strip() for p in args.runs.split(",") if p.strip()], args.output_dir)
    print(f"wrote {files.markdown} and {files.json}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from sapo_megatron.rollout.cpu.server import serve_from_args

    return serve_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
