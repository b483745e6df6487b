"""Does the task learn as well under ``rollout_mode: fully_async`` (max_staleness 2) as synchronously? Held-out
accuracy after RL for ``--seeds`` seeds of each, on the setting of ``tests/rl/test_async_rollout.py``: 64 two-digit
additions trained and evaluated (greedy), a 50-step supervised warm start, ``--steps`` SAPO steps, lr 1e-4,
temperature 0.7, the in-process fp32 CPU engine; each run a real ``sapo-megatron train`` process.

    python bench/bench_fully_async_learning.py [--seeds 3] [--steps 20] [--staleness 2] [--tis-cap 2]

Prints per seed the accuracy before RL (after the warm start, equal in both modes) and after, and the mean
difference fully_async − sync (the issue's bar: within 0.03).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml


def run(root: Path, name: str, seed: int, args, **trainer) -> dict:
    from sapo_megatron.data.prompts import save_jsonl
    from sapo_megatron.data.synthetic import make_addition_rows
    from sapo_megatron.defaults import embedded_default_dict

    rows = make_addition_rows(64, digits=2, seed=5)
    out = root / f"{name}-s{seed}"
    out.mkdir()
    cfg = embedded_default_dict()
    cfg["output_dir"] = str(out / "run")
    cfg["seed"] = seed
    cfg["data"]["train"] = str(save_jsonl(rows * 2, out / "train.jsonl"))
    cfg["eval"] = {
        "every": 0,
        "datasets": [{"name": "heldout", "path": str(save_jsonl(rows, out / "heldout.jsonl"))}],
    }
    cfg["sft"].update(steps=50, lr=1e-3)
    cfg["optimizer"]["lr"] = 1e-4
    cfg["rollout"]["temperature"] = 0.7
    if args.tis_cap:
        cfg["algorithm"]["correction"] = {"name": "tis", "cap": args.tis_cap}
    cfg["trainer"].update(steps=args.steps, prompts_per_step=16, mini_batches=2, export_hf=False, **trainer)
    (out / "run.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "sapo_megatron.cli", "train", str(out / "run.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "run" / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument(
        "--tis-cap", type=float, default=None, help="algorithm.correction: tis with this cap (both)"
    )
    args = parser.parse_args()
    diffs = []
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for seed in range(args.seeds):
            sync = run(Path(tmp), "sync", seed, args, rollout_mode="sync")
            fully = run(
                Path(tmp), "fully_async", seed, args, rollout_mode="fully_async", max_staleness=args.staleness
            )
            diffs.append(fully["accuracy_after"] - sync["accuracy_after"])
            print(
                f"seed {seed}: before {sync['accuracy_before']:.3f} / {fully['accuracy_before']:.3f}, after sync "
                f"{sync['accuracy_after']:.3f}, fully_async (max_staleness {args.staleness}) "
                f"{fully['accuracy_after']:.3f}",
                flush=True,
            )
    print(f"mean fully_async - sync: {statistics.mean(diffs):+.3f} over {args.seeds} seeds")


if __name__ == "__main__":
    main()
