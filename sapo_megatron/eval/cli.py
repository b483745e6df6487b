"""``sapo-megatron eval`` (a model on eval datasets, standalone) and ``sapo-megatron report`` (a run's plots).

``eval --model M [CONFIG] --data NAME=PATH ... --output-dir D``: ``M`` is an HF folder (config.json +
safetensors), a run folder (its ``hf`` export, else its newest checkpoint; its ``config.yaml`` is the default
CONFIG) or a Megatron checkpoint (converted to HF under ``D/hf_model`` first). The datasets are ``--data`` when
given, else CONFIG's ``eval.datasets``; ``--n`` / ``--temperature`` override every dataset. The in-process CPU
engine runs it, or the SGLang (or ``sapo-megatron serve``) servers of ``--urls`` / ``--endpoints-file``.
Writes ``D/eval.json`` and ``D/samples.jsonl`` (:mod:`sapo_megatron.eval.runner`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from sapo_megatron.errors import UserError


class EvalError(UserError, ValueError):
    """A model or dataset the eval command cannot use."""

    exit_code = 2


def add_eval_parser(commands) -> None:
    parser = commands.add_parser(
        "eval",
        help="evaluate a model on eval datasets (avg@n, pass@k, maj@n per dataset and source)",
        description="Evaluate a model on eval datasets: n samples per prompt, scored by each dataset's reward, "
        "summarised as avg@n, pass@k and maj@n per dataset and source. --model is an HF folder, a run folder (its "
        "hf export, else its newest checkpoint; its config.yaml is the default CONFIG) or a Megatron checkpoint "
        "(converted under OUTPUT_DIR/hf_model first). The datasets are --data when given, else CONFIG's "
        "eval.datasets. Runs on the in-process CPU engine, or on the servers of --urls / --endpoints-file. "
        "Writes OUTPUT_DIR/eval.json and OUTPUT_DIR/samples.jsonl (docs/evaluation.md).",
    )
    parser.add_argument("config", nargs="?", help="YAML run config for the eval section, tokenizer and seed")
    parser.add_argument("--model", help="HF folder, run folder or Megatron checkpoint (optional with --urls)")
    parser.add_argument(
        "--data", action="append", default=[], metavar="NAME=PATH", help="an eval dataset; repeatable"
    )
    parser.add_argument("--n", type=int, help="samples per prompt, every dataset")
    parser.add_argument("--temperature", type=float, help="sampling temperature, every dataset (0: greedy)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help="longest response, every dataset (default: the config's; for an HF folder alone, what fits its "
        "context: min(512, max_position_embeddings / 2))",
    )
    parser.add_argument("--seed", type=int, help="sampling seed (default: the config's seed)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field (YAML value)"
    )
    parser.add_argument("--output-dir", required=True, help="where eval.json and samples.jsonl go")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an --output-dir that holds a training run or another command's outputs",
    )
    parser.add_argument(
        "--urls", nargs="+", help="SGLang worker URLs serving the model (default: in-process)"
    )
    parser.add_argument(
        "--endpoints-file", help="JSON with router_url and workers (launch/slurm_rollout.sbatch)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads of the in-process CPU engine"
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of errors")
    parser.set_defaults(handler=run_eval_command)


def add_report_parser(commands) -> None:
    parser = commands.add_parser(
        "report",
        help="plots and report.md of a run (also written at the end of train)",
        description="PNGs of reward, eval metrics, entropy, response length, mismatch and gradient norm over "
        "RL steps, and a short report.md, into RUN_DIR/report/.",
    )
    parser.add_argument("run_dir", help="a run's output directory")
    parser.add_argument("--debug", action="store_true", help="show the traceback of errors")
    parser.set_defaults(handler=run_report_command)


def run_report_command(args: argparse.Namespace) -> int:
    from sapo_megatron.eval.report import write_report

    path = write_report(args.run_dir)
    print(f"wrote {path} and its plots")
    return 0


def run_eval_command(args: argparse.Namespace) -> int:
    from sapo_megatron.data.tokenizer import load_tokenizer
    from sapo_megatron.eval.runner import build_suite, run_suite, write_outputs
    from sapo_megatron.rollout.episodes import with_run_episodes

    out_dir = Path(args.output_dir)
    check_eval_output_dir(args)
    hf_dir, run_config = resolve_model(args.model, out_dir) if args.model else (None, None)
    cfg = eval_config(args, hf_dir, run_config)
    seed = cfg.seed if args.seed is None else args.seed
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if not cfg.eval.datasets:
        raise EvalError("nothing to evaluate: give --data NAME=PATH, or a CONFIG with eval.datasets")
    suite = build_suite(cfg, tokenizer, seed=seed)  # before loading the model
    engine = build_engine(args, cfg, hf_dir, tokenizer, seed)
    served = bool(args.urls or args.endpoints_file)
    engine = with_run_episodes(
        engine, cfg, tokenizer, in_process=not served
    )  # rollout.multi_turn: with tools
    try:
        result = _run_with_bar(
            lambda progress: run_suite(engine, tokenizer, suite, seed=seed, progress=progress), suite
        )
    finally:
        engine.close()
        suite.close()
    model = args.model or ",".join(args.urls or [args.endpoints_file])
    summary, samples = write_outputs(out_dir, model, seed, result)
    for name, metrics in result.metrics.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if "@" in k))
    print(f"{len(result.samples)} samples in {result.seconds:.1f} s ({result.samples_per_s:.1f} samples/s)")
    print(f"wrote {summary} and {samples}")
    return 0


def check_eval_output_dir(args: argparse.Namespace) -> None:
    """Refuse an ``--output-dir`` that holds a run or another command's outputs (unless ``--overwrite``)."""
    from sapo_megatron.runtime.run_dir import check_command_output_dir

    check_command_output_dir(args.output_dir, command="eval", overwrite=getattr(args, "overwrite", False))


def _run_with_bar(work, suite):
    from tqdm import tqdm

    with tqdm(
        total=suite.num_samples, desc="eval", unit="sample", file=sys.stderr, dynamic_ncols=True
    ) as bar:
        return work(bar.update)


def resolve_model(model: str, out_dir: Path) -> tuple[Path, Path | None]:
    """The HF folder to evaluate and the run config that came with it (a run folder's ``config.yaml``)."""
    from sapo_megatron.checkpoint import atomic

    path = Path(model)
    if not path.exists():
        raise EvalError(f"--model {model}: no such file or directory")
    if (path / "config.json").is_file():
        return path, None
    run_config = path / "config.yaml" if (path / "config.yaml").is_file() else None
    if run_config is not None and (path / "hf" / "config.json").is_file():
        return path / "hf", run_config
    try:
        checkpoint = atomic.find_checkpoint(path)
    except UserError as err:
        raise EvalError(
            f"--model {model}: not an HF folder (no config.json), a run folder (config.yaml with hf/ or "
            f"checkpoints/) or a Megatron checkpoint: {err}"
        ) from None
    if run_config is None:  # a checkpoint inside a run: RUN/checkpoints/step_N
        candidates = [p / "config.yaml" for p in checkpoint.parents[:3] if (p / "config.yaml").is_file()]
        run_config = candidates[0] if candidates else None
    try:
        return _convert(checkpoint, out_dir / "hf_model", run_config), run_config
    except FileNotFoundError:
        if checkpoint.exists():
            raise
    # a run still training pruned the checkpoint while it was read: once more with its newest one, else refuse
    newer = atomic.find_checkpoint(path) if path != checkpoint else checkpoint
    if newer == checkpoint or not newer.exists():
        raise EvalError(
            f"--model {model}: the checkpoint {checkpoint} was removed while it was read (the run is still "
            "training and pruned it)",
            hint="evaluate it when the run has finished, or copy a checkpoint out of the run first",
        )
    print(f"{checkpoint} was pruned by the run while it was read; evaluating its newest checkpoint {newer}")
    try:
        return _convert(newer, out_dir / "hf_model", run_config), run_config
    except FileNotFoundError:
        raise EvalError(
            f"--model {model}: the run pruned {checkpoint} and then {newer} while they were read",
            hint="evaluate it when the run has finished, or copy a checkpoint out of the run first",
        ) from None


def _convert(checkpoint: Path, out: Path, run_config: Path | None) -> Path:
    from sapo_megatron.conversion.cli import run_tokenizer_reference
    from sapo_megatron.conversion.to_hf import megatron_to_hf

    reference = run_tokenizer_reference(run_config.parent, out) if run_config else None
    print(f"converting {checkpoint} to an HF checkpoint in {out}")
    return megatron_to_hf(checkpoint, out, reference, force=True, progress=False)


def eval_config(args: argparse.Namespace, hf_dir: Path | None, run_config: Path | None):
    """The run config evaluation reads: CONFIG (else the run's ``config.yaml``, else defaults for ``hf_dir``),
    with ``--set``, ``--data``, ``--n`` and ``--temperature`` applied."""
    from sapo_megatron.config import (
        _read_yaml,
        _resolve_relative_hf_config,
        _set_dotted,
        config_from_dict,
        parse_overrides,
    )

    source = Path(args.config) if args.config else run_config
    if source is not None:
        raw = _read_yaml(source)
    elif hf_dir is not None:
        raw = {"model": {"hf_config": str(hf_dir)}, "data": {"tokenizer": str(hf_dir)}}
    else:
        raise EvalError("with --urls and no --model, give a CONFIG (it names the tokenizer)")
    raw.setdefault("model", {"hf_config": str(hf_dir)})
    if args.data:
        raw["eval"] = {**raw.get("eval", {}), "datasets": [_data_entry(text) for text in args.data]}
    for index, _ in enumerate(raw.get("eval", {}).get("datasets", [])):
        for key in ("n", "temperature"):
            if getattr(args, key) is not None:
                raw["eval"]["datasets"][index][key] = getattr(args, key)
    _apply_max_new_tokens(raw, args.max_new_tokens, hf_dir if source is None else None)
    for dotted, value in parse_overrides(args.set).items():
        _set_dotted(raw, dotted, value)
    if source is not None:
        _resolve_relative_hf_config(raw, source.resolve().parent)
    return config_from_dict(raw, check_layout=False)


DEFAULT_MAX_NEW_TOKENS = 512


def _apply_max_new_tokens(raw: dict[str, Any], max_new_tokens: int | None, bare_hf_dir: Path | None) -> None:
    """``--max-new-tokens`` on every dataset; without it, for an HF folder evaluated without a config, a default
    that leaves half of the model's context to the prompt (a 64-token tiny model gets 32, not 512)."""
    if max_new_tokens is not None:
        if max_new_tokens < 1:
            raise EvalError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
        section = raw.setdefault("eval", {})
        section.setdefault("defaults", {})["max_new_tokens"] = max_new_tokens
        for dataset in section.get("datasets", []):
            dataset["max_new_tokens"] = max_new_tokens
        return
    if bare_hf_dir is not None:
        import json

        context = json.loads((bare_hf_dir / "config.json").read_text()).get("max_position_embeddings")
        if isinstance(context, int) and context > 1:
            raw.setdefault("rollout", {})["max_new_tokens"] = min(DEFAULT_MAX_NEW_TOKENS, context // 2)


def _data_entry(text: str) -> dict[str, Any]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise EvalError(f"--data {text!r}: expected NAME=PATH, e.g. --data aime25=/data/aime25.jsonl")
    return {"name": name, "path": path}


def build_engine(args: argparse.Namespace, cfg: Any, hf_dir: Path | None, tokenizer: Any, seed: int):
    """The in-process CPU engine on ``hf_dir``, or a client of the servers named by ``--urls`` /
    ``--endpoints-file``."""
    if args.urls or args.endpoints_file:
        from sapo_megatron.rollout.sglang.client import SGLangClient
        from sapo_megatron.rollout.sglang.topology import resolve_topology

        api_key = os.environ.get(cfg.rollout.api_key_env) or None
        topology = resolve_topology(
            urls=list(args.urls or []),
            router_url=None,
            endpoints_file=args.endpoints_file,
            api_key=api_key,
            need_routes=False,
            precision=cfg.rollout.precision,
            probe_prompt=[tokenizer.bos_id if tokenizer.bos_id is not None else 0],
            timeout_s=cfg.rollout.startup_timeout_s,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
        return SGLangClient(
            list(topology.workers),
            router_url=topology.router if topology.generate_via_router else None,
            api_key=api_key,
            max_concurrency=cfg.rollout.concurrency,
            timeout_s=cfg.rollout.timeout_s,
            max_retries=cfg.rollout.max_retries,
        )
    if hf_dir is None:
        raise EvalError("give --model (an HF folder, run folder or Megatron checkpoint) or --urls")
    from sapo_megatron.rollout.cpu.engine import CPUEngine

    return CPUEngine.from_pretrained(
        hf_dir, seed=seed, num_threads=args.threads or cfg.rollout.threads, precision=cfg.rollout.precision
    )
