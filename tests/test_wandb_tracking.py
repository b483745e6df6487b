"""Weights & Biases as an optional tracker (issue 29, friction 8), in ``mode: offline`` without network: the run's
config, every ``metrics.jsonl`` row, the samples as a table and the report's plots reach the offline run files; a
resumed run continues the same W&B run; off by default; a missing package is one clear error."""

from __future__ import annotations

import glob
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from sapo_megatron.config import config_from_dict
from sapo_megatron.defaults import embedded_default_dict
from sapo_megatron.runtime.wandb_tracking import WandbMissing, check_trackers

REPO = Path(__file__).resolve().parents[1]
BLOCK = 32768  # the .wandb file: a 7-byte header, then LevelDB-style log blocks of 32 KiB


def wandb_records(path: Path):
    """The protobuf records of an offline run's ``.wandb`` file (read here: wandb 0.2x+ ships no Python reader)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def offline_runs(run_dir: Path) -> list[dict]:
    """Per offline run (oldest first): its id, config keys and history rows (key → decoded value)."""
    runs = []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "*.wandb"))):
        run = {"id": None, "config": {}, "history": []}
        for record in wandb_records(Path(path)):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["config"] = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                run["history"].append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
        runs.append(run)
    return runs


def train(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sapo_megatron.cli", "train", "configs/coming_from/slime_math.yaml", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "WANDB_SILENT": "true"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory) -> Path:
    pytest.importorskip("wandb", reason="W&B is optional; the test extra installs it")
    out = tmp_path_factory.mktemp("wandb") / "run"
    train(
        "--set", f"output_dir={out}", "--set", "sft.steps=2", "--set", "trainer.steps=2",
        "--set", "trainer.save_every=1", "--set", "trainer.log_samples_every=1",
        "--set", "tracking.wandb={project: sapo-test, mode: offline}",
    )  # fmt: skip
    return out


@pytest.mark.slow
def test_config_every_metric_row_samples_and_plots_reach_wandb(wandb_run):
    """Friction 8: what metrics.jsonl, samples.jsonl and report/ hold is in the W&B run."""
    train_run, report_run = offline_runs(wandb_run)
    assert train_run["id"] == report_run["id"] == (wandb_run / "wandb" / "run_id").read_text().strip()
    assert train_run["config"]["name"] == "from-slime-math"
    assert train_run["config"]["rollout"]["n_samples"] == 4
    history = train_run["history"]
    rows = [json.loads(line) for line in (wandb_run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        phase, step = row.pop("phase"), row.pop("step")
        logged = [h for h in history if h.get(f"{phase}/step") == step and f"{phase}/samples/_type" not in h]
        assert len(logged) == 1, (phase, step)
        expected = {f"{phase}/{name}": value for name, value in row.items() if value is not None}
        assert {key: logged[0][key] for key in expected} == pytest.approx(expected)
    tables = [h for h in history if h.get("rl/samples/_type") == "table-file"]
    assert [h["rl/step"] for h in tables] == [1, 2]
    media = wandb_run / "wandb" / sorted(glob.glob("offline-run-*", root_dir=wandb_run / "wandb"))[0]
    table = json.loads((media / "files" / tables[0]["rl/samples/path"]).read_text())
    samples = [json.loads(line) for line in (wandb_run / "samples.jsonl").read_text().splitlines()]
    first = [s for s in samples if s["step"] == 1]
    assert [r[table["columns"].index("response")] for r in table["data"]] == [s["response"] for s in first]
    plots = sorted(p.stem for p in (wandb_run / "report").glob("*.png"))
    assert (
        plots and sorted(k.split("/")[1] for k in report_run["history"][0] if k.endswith("/_type")) == plots
    )


@pytest.mark.slow
def test_resume_continues_the_same_wandb_run(wandb_run):
    """Friction 8: --resume logs the new steps into the W&B run the first start created."""
    before = offline_runs(wandb_run)
    train("--set", f"output_dir={wandb_run}", "--resume", "--set", "trainer.steps=3", *_short())
    after = offline_runs(wandb_run)
    assert len(after) == len(before) + 2  # the resumed training and its report
    assert {run["id"] for run in after} == {before[0]["id"]}
    assert [h["rl/step"] for h in after[-2]["history"] if "rl/loss/total" in h] == [3]


def _short() -> tuple[str, ...]:
    return (
        "--set", "sft.steps=2", "--set", "trainer.save_every=1", "--set", "trainer.log_samples_every=1",
        "--set", "tracking.wandb={project: sapo-test, mode: offline}",
    )  # fmt: skip


def test_off_by_default_and_a_missing_package_is_one_clear_error(monkeypatch):
    cfg = config_from_dict(embedded_default_dict())
    assert cfg.tracking.wandb is None
    check_trackers(cfg)  # nothing asked for: nothing imported
    raw = embedded_default_dict()
    raw["tracking"] = {"wandb": {"project": "p", "mode": "offline"}}
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(
        WandbMissing, match=r"tracking\.wandb is set, but the wandb package is not installed"
    ) as err:
        check_trackers(config_from_dict(raw))
    assert "pip install wandb" in err.value.hint
