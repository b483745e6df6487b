"""A stand-in for ``sapo-megatron train CONFIG --resume auto`` in the runner's tests: it writes what a run writes
(``config.yaml``, ``metrics.jsonl``, ``summary.json``, the warm start's ``hf/config.json``) in milliseconds.

``FAKE_TRAIN`` (JSON: run name → behaviour) picks what a run does: ``finish`` (default), ``fail`` (prints the
trainer's non-finite error and exits 1), ``sigkill`` (dies without a word) or ``wait_for_signal`` (waits for SIGINT, then exits 130 as an
interrupted run does). ``FAKE_TRAIN_LOG`` names a file each start appends its run name to.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import yaml


def main(config_path: str) -> int:
    cfg = yaml.safe_load(Path(config_path).read_text())
    run_dir, name = Path(cfg["output_dir"]), cfg["name"]
    if os.environ.get("FAKE_TRAIN_LOG"):
        with open(os.environ["FAKE_TRAIN_LOG"], "a") as log:
            log.write(name + "\n")
    shutil.copy(config_path, run_dir / "config.yaml")
    behaviour = json.loads(os.environ.get("FAKE_TRAIN", "{}")).get(name, "finish")
    if behaviour == "fail":
        print(
            "sapo-megatron: 3 optimizer steps in a row had a non-finite loss or gradient norm",
            file=sys.stderr,
        )
        print("hint: lower optimizer.lr", file=sys.stderr)
        return 1
    if behaviour == "wait_for_signal":
        return wait_for_signal(run_dir)
    if behaviour == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    steps = cfg["trainer"]["steps"]
    rows = [
        {"phase": "rl", "step": s, "reward/mean": 0.5, "entropy": 1.0, "grad_norm": 1.0}
        for s in range(1, steps + 1)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if steps == 0:
        (run_dir / "hf").mkdir(exist_ok=True)
        (run_dir / "hf" / "config.json").write_text("{}")
    summary = {"steps": steps, "accuracy_before": 0.5, "accuracy_after": 0.5}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return 0


def wait_for_signal(run_dir: Path) -> int:
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    (run_dir / "started").touch()
    deadline = time.monotonic() + 30
    while not received and time.monotonic() < deadline:
        time.sleep(0.01)
    (run_dir / "signals").write_text(str(len(received)))
    return 130 if received else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
