"""The flags of ``sapo-megatron serve`` (SGLang's ``launch_server`` names), apart from the server itself so that
``sapo-megatron --help`` builds its parser without importing torch (:mod:`sapo_megatron.rollout.cpu.server`
re-exports them)."""

from __future__ import annotations

import argparse

DIST_TIMEOUT_S = 1800.0
"""The default of ``--dist-timeout``: :data:`sapo_megatron.rollout.weight_group.DEFAULT_TIMEOUT_S` (a test keeps
the two equal; that module imports torch)."""

# This server's own limits (SGLang has none of these flags); the server modules import their defaults from here.
DEFAULT_MAX_BODY_BYTES = (
    64 << 20
)  # 64 MiB: 256 rows of 64k-token prompts as JSON ids fit; tensor payloads are KBs
DEFAULT_MAX_CONNECTIONS = 256  # above the client's concurrency (64-128); each connection is one thread
DEFAULT_MAX_ROWS_PER_REQUEST = 256  # the client sends one row per request; scoring batches stay far below
DEFAULT_CONNECT_TIMEOUT_S = 10.0  # a weight group's master must answer within this

# SGLang's --dtype choices (server_args.py): "float" means float32 and "half" float16.
DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """SGLang's ``launch_server`` flags that mean something here (same names, so scripts can swap servers)."""
    parser.add_argument(
        "--model-path",
        "--model",
        dest="model_path",
        required=True,
        help="HF checkpoint directory (config.json)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument(
        "--port",
        type=int,
        default=30000,
        help="port to listen on, 0 for any free port (default: %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health* (default: %(default)s, no key)",
    )
    parser.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        "--tp",
        dest="tp_size",
        type=int,
        default=1,
        help="tensor-parallel size; the CPU server runs one rank, so only 1 (default: %(default)s)",
    )
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="accepted for SGLang compatibility: MoE models always return routed experts on request "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="weights and activations: bfloat16 or float32 (float); auto is float32 without --quantization and "
        "bfloat16 with it (SGLang's auto would serve a float32 checkpoint in float16); half/float16 are refused "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        help="fp8: SGLang's block-wise W8A8 fp8 (128x128 weight blocks) on the decoder's linear layers, with "
        "bfloat16 activations; the only method here (default: %(default)s, none)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the forwards (default: %(default)s: torch's)",
    )
    parser.add_argument(
        "--seed",
        "--random-seed",
        dest="seed",
        type=int,
        default=0,
        help="seed for requests without sampling_seed (default: %(default)s)",
    )
    parser.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="as SGLang's: release_memory_occupation really frees memory; here released weights come back as "
        "garbage on resume unless --enable-weights-cpu-backup, as on a GPU (default: %(default)s)",
    )
    parser.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="with --enable-memory-saver: keep a CPU copy of released weights and restore it on resume "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=DIST_TIMEOUT_S,
        help="seconds a weights update group may take to form, and each broadcast over it (default: %(default)s)",
    )
    parser.add_argument(
        "--static-batches",
        action="store_true",
        help="run concurrent requests as static batches to completion instead of continuous batching (requests "
        "joining and leaving the running batch between decode steps, as SGLang) (default: %(default)s)",
    )
    add_limit_arguments(parser)


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """This server's own limits and guards (SGLang has no such flags; see docs/cluster.md)."""
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are answered 413 without being read (default: %(default)s)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="connections served at once (one thread each); more get 503 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-rows-per-request",
        type=int,
        default=DEFAULT_MAX_ROWS_PER_REQUEST,
        help="rows (input_ids lists) one /generate request may carry (default: %(default)s)",
    )
    parser.add_argument(
        "--allowed-weight-dir",
        action="append",
        default=None,
        help="a directory update_weights_from_disk may load from (repeatable) (default: %(default)s: the parent "
        "of --model-path)",
    )
    parser.add_argument(
        "--allowed-master-address",
        action="append",
        default=[],
        help="a weight-group master address to accept besides the requesting trainer and loopback (repeatable) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--tensor-sender-pid",
        action="append",
        type=int,
        default=[],
        help="a local trainer process whose shared-memory tensor handles may be opened (repeatable) "
        "(default: %(default)s: only this process)",
    )
    parser.add_argument(
        "--weight-group-connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        help="seconds the weight group's master may take to answer before the group is refused "
        "(default: %(default)s)",
    )
