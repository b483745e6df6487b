"""tools/drift_summary.py (docs/losses/evidence.md's drift table): per routing-replay mode, the median and the
10th–90th percentile over every arm's RL steps, and the share of steps whose ratio p99.9 is above 2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

TOOL = Path(__file__).resolve().parents[2] / "tools" / "drift_summary.py"


def _tool():
    spec = importlib.util.spec_from_file_location("drift_summary", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _arm(root: Path, name: str, replay: str, p999: list[float], k3: list[float]) -> None:
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"routing_replay": replay}}))
    rows = [{"phase": "eval", "step": 0, "eval/heldout/avg@1": 0.5}]
    rows += [
        {
            "phase": "rl",
            "step": i + 1,
            "ratio/p99.9": p,
            "ratio/max": 2 * p,
            "routing/agreement": 0.99,
            "routing/agreement_used": 1.0 if replay == "r3" else 0.99,
            "mismatch/k3": k,
        }
        for i, (p, k) in enumerate(zip(p999, k3))
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_drift_per_replay_mode(tmp_path):
    _arm(tmp_path, "sapo-none-none-s0", "none", [1.5, 3.0, 5.0], [0.01, 0.02, 0.03])
    _arm(tmp_path, "grpo-none-none-s0", "none", [1.0, 2.5], [0.04, 0.05])
    _arm(tmp_path, "sapo-r3-none-s0", "r3", [1.2, 1.4], [0.001, 0.002])
    (tmp_path / "warm_start").mkdir()  # skipped: no RL steps of an arm
    table = _tool().summary(tmp_path).splitlines()
    rows = {line.split(" | ")[0].strip("| "): line for line in table[2:]}
    none = [cell.strip() for cell in rows["none"].strip("|").split("|")]
    # 5 steps: p99.9 values 1, 1.5, 2.5, 3, 5 → median 2.5, 10th pct 1, 90th 5; 3 of 5 above 2
    assert none[:3] == ["none", "2", "5"]
    assert none[3] == "2.5 (1–5)"
    assert none[4] == "5 (2–10)"
    assert none[7] == "0.03 (0.01–0.05)"
    assert none[8] == "60%"
    r3 = [cell.strip() for cell in rows["r3"].strip("|").split("|")]
    assert r3[1:3] == ["1", "2"] and r3[6].startswith("1 (") and r3[8] == "0%"
