"""The drift a comparison's arms saw, per routing-replay mode, from their ``metrics.jsonl`` (docs/losses/evidence.md).

    python tools/drift_summary.py runs/loss_evidence            # a markdown table on stdout

Per RL step of every arm: the token-ratio quantiles ``ratio/p99.9`` and ``ratio/max`` (current policy vs the
old-log-prob pass, over the step's updates: the off-policy drift of updates 2..N), ``routing/agreement`` (the
trainer's live routing vs the engine's) and ``routing/agreement_used`` (the routing the training forward used vs
the engine's), and ``mismatch/k3`` (engine vs trainer log-probs of the sampled tokens). Rows: the arms grouped by
``routing_replay``; each cell the median over the group's steps, with the 10th–90th percentile.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import yaml

QUANTITIES = (
    ("ratio/p99.9", "token ratio p99.9"),
    ("ratio/max", "token ratio max"),
    ("routing/agreement", "routing agreement (live)"),
    ("routing/agreement_used", "routing agreement (used)"),
    ("mismatch/k3", "mismatch k3"),
)


def rl_rows(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if row.get("phase", "rl") == "rl" and "ratio/p99.9" in row]


def replay_of(run_dir: Path) -> str:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return str(config["algorithm"]["routing_replay"])


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def summary(output_dir: Path) -> str:
    groups: dict[str, dict[str, list[float]]] = {}
    arms: dict[str, int] = {}
    for run_dir in sorted(p for p in output_dir.iterdir() if (p / "metrics.jsonl").exists()):
        if run_dir.name == "warm_start":
            continue
        replay = replay_of(run_dir)
        arms[replay] = arms.get(replay, 0) + 1
        values = groups.setdefault(replay, {key: [] for key, _ in QUANTITIES})
        for row in rl_rows(run_dir):
            for key, _ in QUANTITIES:
                if key in row:
                    values[key].append(float(row[key]))
    head = (
        "| replay | arms | steps | "
        + " | ".join(title for _, title in QUANTITIES)
        + " | steps with p99.9 > 2 |"
    )
    lines = [head, "|" + "---|" * (len(QUANTITIES) + 4)]
    for replay, values in groups.items():
        steps = len(values["ratio/p99.9"])
        cells = []
        for key, _ in QUANTITIES:
            got = values[key]
            cells.append(
                f"{statistics.median(got):.4g} ({quantile(got, 0.1):.3g}–{quantile(got, 0.9):.3g})"
                if got
                else "–"
            )
        share = sum(v > 2 for v in values["ratio/p99.9"]) / max(steps, 1)
        lines.append(f"| {replay} | {arms[replay]} | {steps} | " + " | ".join(cells) + f" | {share:.0%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/drift_summary.py COMPARE_OUTPUT_DIR")
    print(summary(Path(sys.argv[1])))
