"""``sapo-megatron convert …``: HF ⇄ Megatron conversion and the logit-parity check from the command line.

    sapo-megatron convert hf-to-megatron --hf DIR --out DIR [--force]
    sapo-megatron convert megatron-to-hf --megatron DIR --out DIR [--hf-reference DIR] [--max-shard-size 5GB]
        (DIR: a checkpoint, a folder with a 'latest' pointer, or a training run's output_dir)
    sapo-megatron convert verify --hf DIR --megatron DIR [--tolerance X] [--tp N --pp N --ep N ...]

``verify`` under ``torchrun`` checks a parallel layout (every rank runs the command). Exit status: 0 on success,
1 when the parity check fails, 2 on invalid input (the message names the problem). An output directory that is,
contains or lies inside an input is refused before anything is written, even with ``--force``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from sapo_megatron.checkpoint import atomic
from sapo_megatron.checkpoint.atomic import IncompleteCheckpointError
from sapo_megatron.errors import UserError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """``5GB`` → 5·10⁹ bytes, ``512MiB`` → 512·2²⁰, ``1000`` → 1000."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    binary = "I" in unit
    prefix = unit.replace("I", "").replace("B", "")
    factor = 1024 ** "KMGT".index(prefix) * 1024 if binary and prefix else _UNITS[prefix]
    return int(number * factor)


def add_convert_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``convert`` (with ``hf-to-megatron``, ``megatron-to-hf``, ``verify``) to a CLI's subcommands.

    Each leaf parser sets ``func`` (and the same as ``handler``): ``args.func(args)`` runs it and returns the
    exit status.
    """
    convert = subparsers.add_parser("convert", help="HF ⇄ Megatron checkpoint conversion and parity check")
    commands = convert.add_subparsers(dest="convert_command", required=True, metavar="COMMAND")

    h2m = commands.add_parser("hf-to-megatron", help="HF safetensors → Megatron torch_dist (any layout)")
    h2m.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    h2m.add_argument("--out", required=True, help="output Megatron checkpoint directory")
    h2m.add_argument("--workers", type=int, default=None, help="threads building tensors (default: ≤4)")
    _common_output_args(h2m)
    h2m.set_defaults(func=run_hf_to_megatron, handler=run_hf_to_megatron)

    m2h = commands.add_parser("megatron-to-hf", help="Megatron torch_dist → HF safetensors")
    m2h.add_argument(
        "--megatron",
        required=True,
        help="Megatron checkpoint, a folder with a 'latest' pointer, or a training run's output_dir",
    )
    m2h.add_argument("--out", required=True, help="output HF checkpoint directory")
    m2h.add_argument(
        "--hf-reference",
        default=None,
        help="HF directory to copy tokenizer files from (default for a run folder: its hf/ export)",
    )
    m2h.add_argument("--max-shard-size", type=parse_size, default="5GB", help="per safetensors file")
    m2h.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="default: as stored")
    _common_output_args(m2h)
    m2h.set_defaults(func=run_megatron_to_hf, handler=run_megatron_to_hf)

    ver = commands.add_parser("verify", help="logit parity: HF transformers vs the Megatron checkpoint")
    ver.add_argument("--hf", required=True, help="HF checkpoint directory")
    ver.add_argument("--megatron", required=True, help="Megatron checkpoint directory")
    ver.add_argument("--tolerance", type=float, default=None, help="max |Δlogit| (default by dtype)")
    ver.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ver.add_argument("--batch", type=int, default=2)
    ver.add_argument("--seq-len", type=int, default=32)
    ver.add_argument("--seed", type=int, default=0)
    for name in ("tp", "pp", "ep", "etp"):
        ver.add_argument(f"--{name}", type=int, default=None, help=f"parallel.{name} (under torchrun)")
    ver.add_argument("--sequence-parallel", action="store_true")
    ver.set_defaults(func=run_verify, handler=run_verify)
    return convert


def _common_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _fail(err: BaseException) -> int:
    print(f"error: {err}", file=sys.stderr)
    return 2


_INPUT_ERRORS = (UserError, ValueError, FileExistsError, IncompleteCheckpointError)
"""Bad input, reported as one line (ConversionError, ArchError, CheckpointMismatchError are ValueErrors;
MappingError is a UserError: its module imports torch, so it is not named here)."""


def run_hf_to_megatron(args: argparse.Namespace) -> int:
    from sapo_megatron.conversion.to_megatron import hf_to_megatron

    try:
        out = hf_to_megatron(
            args.hf, args.out, force=args.force, workers=args.workers, progress=not args.no_progress
        )
    except _INPUT_ERRORS as err:
        return _fail(err)
    print(f"wrote Megatron checkpoint {out}")
    return 0


def run_megatron_to_hf(args: argparse.Namespace) -> int:
    from sapo_megatron.conversion.to_hf import megatron_to_hf

    reference = args.hf_reference or run_tokenizer_reference(Path(args.megatron), Path(args.out))
    if reference is not None and args.hf_reference is None:
        print(f"copying the run's tokenizer files from {reference}")
    try:
        out = megatron_to_hf(
            args.megatron,
            args.out,
            reference,
            max_shard_bytes=args.max_shard_size,
            dtype=args.dtype,
            force=args.force,
            progress=not args.no_progress,
        )
    except _INPUT_ERRORS as err:
        return _fail(err)
    print(f"wrote HF checkpoint {out}")
    return 0


def run_tokenizer_reference(run_dir: Path, out: Path) -> Path | None:
    """For a training run's output_dir: the folder holding its tokenizer files (its final HF export, else the
    rollout weights), so that the export is complete without ``--hf-reference``; None for other inputs."""
    from sapo_megatron.conversion.params import TOKENIZER_FILES

    if not (run_dir / atomic.RUN_CHECKPOINTS).is_dir():
        return None
    for candidate in (run_dir / "hf", run_dir / "rollout_weights"):
        has_tokenizer = any((candidate / name).is_file() for name in TOKENIZER_FILES)
        if has_tokenizer and atomic.path_relation(out, candidate) is None:
            return candidate
    return None


def run_verify(args: argparse.Namespace) -> int:
    from sapo_megatron.conversion.verify import verify

    parallel = {k: getattr(args, k) for k in ("tp", "pp", "ep", "etp") if getattr(args, k) is not None}
    if args.sequence_parallel:
        parallel["sequence_parallel"] = True
    try:
        report = verify(
            args.hf,
            args.megatron,
            tolerance=args.tolerance,
            dtype=args.dtype,
            batch=args.batch,
            seq_len=args.seq_len,
            seed=args.seed,
            parallel=parallel,
        )
    except _INPUT_ERRORS as err:
        return _fail(err)
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m sapo_megatron.conversion.cli convert …``."""
    parser = argparse.ArgumentParser(prog="sapo-megatron")
    add_convert_parser(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
