"""The flags of ``sapo-megatron serve`` (SGLang's ``launch_server`` names), apart from the server itself so that
``sapo-megatron --help`` builds its parser without importing torch (:mod:`sapo_megatron.rollout.cpu_server`
re-exports them)."""

from __future__ import annotations

import argparse

DIST_TIMEOUT_S = 1800.0
"""The default of ``--dist-timeout``: :data:`sapo_megatron.rollout.weight_group.DEFAULT_TIMEOUT_S` (a test keeps
the two equal; that module imports torch)."""

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
        "--dist-timeout",
        type=float,
        default=DIST_TIMEOUT_S,
        help="seconds a weights update group may take to form, and each broadcast over it (default: %(default)s)",
    )
