#!/usr/bin/env python
"""One prepared GPU check (docs/gpu.md): on one CUDA device, in one process (plus one receiving process), build the
tiny Qwen3 / Qwen3-MoE / Qwen3-VL-MoE models and check logit parity against HF transformers (fp32 and bf16; the
Transformer Engine spec when TE imports), run SFT and SAPO steps (fp32, bf16, FP8 with TE) and the VL model with
images, each FP8 recipe against bf16, packed (block mask; THD with TE) against padded micro-batches, trainer
offload to pinned memory with its bitwise check, the chunked log-prob kernel's memory and values, the planner
against the allocator, the NCCL process group of one, and CUDA-IPC tensor transport to a second process; report
which fused kernels are active; print a table of what was verified.

Before anything runs it checks that every module the rows import is there (a missing one: one line naming it and
the kit, exit 3) and prints which rows will SKIP here and why (no TE: the TE spec, FP8, THD packing; a recipe
the GPU cannot run). A row that fails prints its traceback and FAIL; the others still run.

    python tools/gpu_check.py                       # on a CUDA machine; exit 1 if any row FAILs
    python tools/gpu_check.py --out DIR             # also writes DIR/gpu_check_table.md and DIR/gpu_check.json
    python tools/gpu_check.py --allow-cpu           # the same rows on CPU (the CPU test suite; the kit's proof)

Needs: torch, transformers, megatron-core, pydantic (tools/gpu_kit.sh brings those the GPU machine lacks).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# What the rows import, project modules first: each missing third-party module is reported with the project
# module that needs it (the kit must hold its wheel).
NEEDED_MODULES = (
    "sapo_megatron.config",
    "sapo_megatron.model.tiny",
    "sapo_megatron.model.arch",
    "sapo_megatron.model.batching",
    "sapo_megatron.model.packing",
    "sapo_megatron.model.precision",
    "sapo_megatron.megatron.parallel",
    "sapo_megatron.megatron.model",
    "sapo_megatron.megatron.train_step",
    "sapo_megatron.megatron.loss_hook",
    "sapo_megatron.megatron.sft",
    "sapo_megatron.megatron.offload",
    "sapo_megatron.megatron.logprobs",
    "sapo_megatron.megatron.activation_probe",
    "sapo_megatron.plan.activations",
    "sapo_megatron.rollout.tensor_transport",
    "megatron.core.models.backends",
    "megatron.core.optimizer",
    "transformers",
)
NO_TE = "transformer_engine is not installed"


@dataclass
class Check:
    name: str
    status: str  # PASS / FAIL / SKIP
    detail: str
    seconds: float = 0.0


def runs_anywhere() -> str | None:
    return None


@dataclass
class Row:
    name: str
    run: Callable[[], str]
    skip: Callable[[], str | None] = runs_anywhere  # the reason it cannot run here, known before it starts


def run_check(results: list[Check], row: Row, reason: str | None) -> None:
    from gpu_check_rows import SkipCheck

    start = time.perf_counter()
    if reason:
        status, detail = "SKIP", reason
    else:
        try:
            detail = row.run()
            status = "PASS"
        except SkipCheck as skip:
            status, detail = "SKIP", str(skip)
        except Exception as err:  # a failed check is reported in the table, with its traceback on stderr
            traceback.print_exc()
            status, detail = "FAIL", f"{type(err).__name__}: {err}"
    seconds = time.perf_counter() - start
    results.append(Check(row.name, status, f"{detail} ({seconds:.1f} s)", round(seconds, 2)))
    print(f"[{status}] {row.name}: {detail}", flush=True)


def missing_module() -> str | None:
    """One line naming the first module the rows need that does not import, and what to do; None when all do."""
    for module in NEEDED_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            return (
                f"gpu_check: cannot import {err.name} (needed by {module}): its wheel is not installed here. On "
                "the GPU machine install the kit first (docs/gpu.md); if the kit has it not, add its pin to "
                "tools/gpu_kit/kit.txt and run tools/gpu_kit.sh again"
            )
    return None


def build_rows(checks) -> list[Row]:
    from gpu_check_rows import FP8_RECIPES, have
    from gpu_check_transport import group_of_one, tensor_transport

    from sapo_megatron.model.precision import fp8_runtime_problem

    def te(reason: str = NO_TE) -> Callable[[], str | None]:
        return lambda: None if have("transformer_engine") else reason

    rows: list[Row] = []
    for kind in ("dense", "moe"):
        rows += [
            Row(f"{kind}: logit parity vs HF, local spec", lambda k=kind: checks.parity(k, False)),
            Row(f"{kind}: logit parity vs HF, local spec, bf16", lambda k=kind: checks.parity_bf16(k)),
            Row(f"{kind}: logit parity vs HF, TE spec", lambda k=kind: checks.parity(k, True), te()),
        ]
        for dtype in ("fp32", "bf16", "fp8"):
            rows.append(
                Row(
                    f"{kind}: SFT + SAPO steps, {dtype}",
                    lambda k=kind, d=dtype: checks.train_steps(k, d),
                    te("FP8 needs transformer_engine, which is not installed")
                    if dtype == "fp8"
                    else runs_anywhere,
                )
            )
        rows += [
            Row(f"{kind}: packed vs padded micro-batches", lambda k=kind: checks.packing(k)),
            Row(
                f"{kind}: packed THD through TE vs padded",
                lambda k=kind: checks.packing_thd(k),
                te("THD packing runs through Transformer Engine's attention, which is not installed"),
            ),
            Row(f"{kind}: trainer offload and onload", lambda k=kind: checks.offload_round_trip(k)),
        ]
    rows += [
        Row("vl_moe: logit parity vs HF (images), local spec", lambda: checks.vl_parity(False)),
        Row("vl_moe: logit parity vs HF (images), TE spec", lambda: checks.vl_parity(True), te()),
    ]
    for dtype in ("fp32", "bf16", "fp8"):
        rows.append(
            Row(
                f"vl_moe: SFT steps with images, {dtype}",
                lambda d=dtype: checks.vl_train_steps(d),
                te("FP8 needs transformer_engine, which is not installed")
                if dtype == "fp8"
                else runs_anywhere,
            )
        )
    for recipe in FP8_RECIPES:
        rows.append(
            Row(
                f"fp8 {recipe} vs bf16: loss, logits, step time",
                lambda r=recipe: checks.fp8_recipe(r),
                lambda r=recipe: fp8_runtime_problem(r),
            )
        )
    return [
        *rows,
        Row(
            "context parallel: chunks = TE's THD partition",
            checks.cp_partition,
            te("the THD partition is Transformer Engine's, which is not installed"),
        ),
        Row("context parallel: THD RoPE = RoPE at global positions", checks.cp_rope),
        Row("fused paths active", checks.fused_paths),
        Row("planner: activations vs measured", checks.planner_activations),
        Row("chunked log-probs: memory and values vs naive", checks.logprob_memory),
        Row("process group of one: collectives", lambda: group_of_one(checks.device)),
        Row("tensor transport to a second process", lambda: tensor_transport(checks.device)),
    ]


def announce(plan: list[tuple[Row, str | None]], device: torch.device) -> None:
    skips = [(row, reason) for row, reason in plan if reason]
    print(f"gpu_check: {len(plan)} rows, {len(plan) - len(skips)} to run, {len(skips)} will SKIP here:")
    for row, reason in skips:
        print(f"  SKIP  {row.name}: {reason}")
    if device.type != "cuda":
        print(
            "  on CPU: the process group is gloo (NCCL on a GPU), the transport uses shared-memory files (CUDA IPC "
            "on a GPU), the log-prob row checks values only (memory needs the CUDA allocator), offload copies are "
            "pageable (pinned on a GPU)"
        )
    print(flush=True)


def environment(device: torch.device) -> dict:
    from gpu_check_rows import _version, have

    kit = ROOT / os.environ.get("GPU_KIT_DIR", ".gpu_kit") / "manifest.txt"
    env = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _kit_commit(kit),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "transformers": _version("transformers"),
        "megatron-core": _version("megatron_core"),
        "transformer_engine": _version("transformer_engine") if have("transformer_engine") else None,
    }
    if device.type == "cuda":
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return env


def _kit_commit(manifest: Path) -> str:
    """The commit the kit was built at (its manifest's ``commit`` line), else 'unknown'."""
    if manifest.is_file():
        for line in manifest.read_text().splitlines():
            if line.startswith("commit "):
                return line.split(maxsplit=1)[1]
    return "unknown (no kit manifest)"


def table(results: list[Check]) -> str:
    lines = ["| check | status | detail |", "|---|---|---|"]
    lines += [f"| {c.name} | {c.status} | {_cell(c.detail)} |" for c in results]
    return "\n".join(lines)


def _cell(text: str) -> str:
    """A detail as one Markdown table cell (its ``|`` escaped: "max \\|Δlogit\\|")."""
    return text.replace("|", "\\|")


def write_outputs(out: Path, env: dict, results: list[Check]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    counts = {s: sum(c.status == s for c in results) for s in ("PASS", "FAIL", "SKIP")}
    head = ", ".join(f"{k} {v}" for k, v in env.items() if v is not None)
    summary = ", ".join(f"{v} {k}" for k, v in counts.items())
    (out / "gpu_check_table.md").write_text(f"{head}\n\n{summary}\n\n{table(results)}\n")
    (out / "gpu_check.json").write_text(
        json.dumps({"environment": env, "counts": counts, "rows": [asdict(c) for c in results]}, indent=1)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU when no GPU is present")
    parser.add_argument("--out", type=Path, help="write gpu_check_table.md and gpu_check.json here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            "gpu_check: no CUDA device here; nothing was checked (use --allow-cpu to exercise the script on CPU)"
        )
        return 2
    problem = missing_module()
    if problem:
        print(problem, flush=True)
        return 3
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    from gpu_check_rows import Checks

    from sapo_megatron.config import ParallelConfig
    from sapo_megatron.megatron.parallel import init_parallel, shutdown_parallel

    env = environment(device)
    print(", ".join(f"{k} {v}" for k, v in env.items()))
    init_parallel(ParallelConfig(), seed=0)
    results: list[Check] = []
    with tempfile.TemporaryDirectory() as tmp:
        checks = Checks(Path(tmp), device)
        plan = [(row, row.skip()) for row in build_rows(checks)]
        announce(plan, device)
        for row, reason in plan:
            run_check(results, row, reason)
    shutdown_parallel()
    print("\n" + table(results))
    if args.out:
        write_outputs(args.out, env, results)
    return 1 if any(c.status == "FAIL" for c in results) else 0


if __name__ == "__main__":
    sys.exit(main())
