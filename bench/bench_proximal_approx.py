"""The time the loglinear proximal approximation saves: the same fully-async run (deterministic schedule,
``max_staleness`` 2) with ``algorithm.proximal_logp: recompute`` (the old-policy forward pass) and ``loglinear``
(no such pass), each a real ``sapo-megatron train`` process on the embedded demo; prints the median
``time/train_s`` (the step's passes and updates) over steps 2.. and the saving.

    python bench/bench_proximal_approx.py [--steps 8] [--mini-batches 1] [--prompts 16]
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


def run(root: Path, proximal: str, args) -> list[float]:
    from sapo_megatron.defaults import embedded_default_dict

    cfg = embedded_default_dict()
    (root / proximal).mkdir()
    cfg["output_dir"] = str(root / proximal / "run")
    cfg["sft"]["steps"] = 0
    cfg["eval"] = {"datasets": []}
    cfg["algorithm"]["proximal_logp"] = proximal
    cfg["algorithm"]["correction"] = {"name": "tis", "cap": 2.0}
    cfg["trainer"].update(
        steps=args.steps,
        prompts_per_step=args.prompts,
        mini_batches=args.mini_batches,
        export_hf=False,
        rollout_mode="fully_async",
        fully_async_deterministic=True,
        max_staleness=2,
    )
    path = root / proximal / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "sapo_megatron.cli", "train", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    rows = [json.loads(line) for line in (root / proximal / "run" / "metrics.jsonl").read_text().splitlines()]
    return [row["time/train_s"] for row in rows if row["phase"] == "rl"][1:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--mini-batches", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        times = {name: run(Path(tmp), name, args) for name in ("recompute", "loglinear")}
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        print(f"{name:10s} median time/train_s {value:.3f} s over steps 2-{args.steps}")
    saving = 1 - medians["loglinear"] / medians["recompute"]
    print(
        f"loglinear saves {saving:.1%} of the step's training time ({args.mini_batches} update(s) per step)"
    )


if __name__ == "__main__":
    main()
