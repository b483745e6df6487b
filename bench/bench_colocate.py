"""Per-phase times of a colocated CPU step against the disaggregated one: the embedded demo (tiny Qwen3-MoE, the
CPU server in the trainer's process over HTTP, tensor sync), the same run twice, with and without
``rollout.colocation: time_shared`` (trainer offloaded, weights checked), printing the median of each ``time/*`` and
``colocate/*`` metric over the RL steps.

    python bench/bench_colocate.py [--steps 4]
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

ARMS = {
    "disaggregated": {},
    "colocated": {"offload_trainer": True, "check_weights": True},
}


def run(root: Path, steps: int, colocate: dict | None) -> list[dict]:
    from sapo_megatron.defaults import embedded_default_dict

    cfg = embedded_default_dict()
    cfg["output_dir"] = str(root / "run")
    cfg["sft"]["steps"] = 5
    cfg["trainer"].update(steps=steps, save_every=0)
    cfg["eval"] = {"datasets": []}
    cfg["rollout"].update(engine="cpu_http", weight_sync="tensor")
    if colocate is not None:
        cfg["rollout"]["colocation"] = {"name": "time_shared", **colocate}
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    subprocess.run(
        [sys.executable, "-m", "sapo_megatron.cli", "train", str(config)], check=True, capture_output=True
    )
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "rl"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for name, colocate in ARMS.items():
            root = Path(tmp) / name
            root.mkdir()
            results[name] = run(root, args.steps, colocate or None)
    keys = sorted(
        {k for rows in results.values() for r in rows for k in r if k.startswith(("time/", "colocate/"))}
    )
    print(f"{'metric (median over RL steps)':44s} " + " ".join(f"{n:>14s}" for n in results))
    for key in keys:
        cells = []
        for rows in results.values():
            values = [r[key] for r in rows if r.get(key) is not None]
            cells.append(f"{statistics.median(values):14.4f}" if values else f"{'-':>14s}")
        print(f"{key:44s} " + " ".join(cells))


if __name__ == "__main__":
    main()
