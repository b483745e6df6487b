"""``sapo-megatron`` command line: train (the RL loop; with no config, the embedded tiny demo), convert, serve."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from typing import Any

import yaml

from sapo_megatron.config import ConfigError, RunConfig, load_config, validate_layout


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.handler(args) or 0)
    except ConfigError as err:
        print(f"sapo-megatron: configuration error\n{err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sapo-megatron", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_train_parser(commands)
    _add_serve_parser(commands)
    _add_convert_parser(commands)
    return parser


def _add_train_parser(commands) -> None:
    train = commands.add_parser("train", help="run a training job (the embedded tiny demo without CONFIG)")
    train.add_argument("config", nargs="?", help="YAML run config; omit for the embedded default")
    train.add_argument("--output-dir", help="where the run writes (overrides output_dir)")
    train.add_argument(
        "--dry-run", action="store_true", help="validate and print the resolved layout, then stop"
    )
    train.add_argument("--world-size", type=int, help="world size to check the layout against (dry run)")
    train.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in output_dir"
    )
    train.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field (YAML value)"
    )
    train.set_defaults(handler=_train)


def _add_serve_parser(commands) -> None:
    serve = commands.add_parser(
        "serve", help="serve an HF model with the CPU rollout engine (SGLang's HTTP API)"
    )
    serve.add_argument("--model", required=True, help="HF model directory")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--threads", type=int, default=None)
    serve.set_defaults(handler=_serve)


def _add_convert_parser(commands) -> None:
    from sapo_megatron.checkpoint.cli import add_convert_parser

    add_convert_parser(commands)


def _parse_overrides(pairs: list[str]) -> dict[str, Any]:
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set parallel.tp=2")
        overrides[key] = yaml.safe_load(value)
    return overrides


def resolve_config(args: argparse.Namespace) -> RunConfig:
    overrides = _parse_overrides(args.set)
    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    return load_config(args.config, overrides)


def _train(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    if args.dry_run:
        return _dry_run(cfg, args.world_size)
    world = cfg.launch.world_size
    if world > 1 and "WORLD_SIZE" not in os.environ:
        return _relaunch_under_torchrun(cfg, args.argv)
    from sapo_megatron.trainer import run

    run(cfg, resume=args.resume)
    return 0


def _dry_run(cfg: RunConfig, world_size: int | None) -> int:
    from sapo_megatron.plan import format_plan

    world = world_size or cfg.launch.world_size
    validate_layout(cfg, world)
    print(f"config OK: {cfg.name} -> {cfg.output_dir}")
    print(format_plan(cfg, world))
    return 0


def _relaunch_under_torchrun(cfg: RunConfig, argv: list[str]) -> int:
    """Start ``procs_per_node`` local processes (multi-node jobs start under SLURM, see launch/)."""
    if cfg.launch.nodes > 1:
        raise ConfigError(
            f"launch.nodes={cfg.launch.nodes}: multi-node jobs start through launch/slurm_train.sbatch, not directly"
        )
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={cfg.launch.procs_per_node}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "-m",
        "sapo_megatron.cli",
        *argv,
    ]
    return subprocess.call(command)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for local rendezvous and test servers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(args: argparse.Namespace) -> int:
    from sapo_megatron.rollout.cpu_server import serve

    serve(args.model, args.host, args.port, num_threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
