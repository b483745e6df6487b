"""A run's plots and ``report.md`` (``sapo-megatron report RUN_DIR``, and at the end of ``train``).

Reads ``metrics.jsonl`` (RL rows and eval rows) and ``summary.json``; writes into ``RUN_DIR/report/`` one PNG per
quantity over RL steps – reward, eval metrics (one panel per dataset: avg@n, pass@k, maj@n), entropy, response
length, mismatch k3 and gradient norm – drawn like the comparison's plots (:mod:`sapo_megatron.compare.plots`:
matplotlib's object API on the Agg canvas, small palette PNGs, log axes for k3 and gradient norm), and a short
``report.md`` with the last evaluation's table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sapo_megatron.compare.plots import FIGURE_SIZE, LOG_SCALE, save_small_png
from sapo_megatron.errors import UserError

REPORT_DIR = "report"
RL_PLOTS: tuple[tuple[str, str, str], ...] = (
    ("reward", "reward (mean over the step's samples)", "reward/mean"),
    ("entropy", "entropy (nats per token)", "entropy"),
    ("response_length", "response length (tokens, mean)", "response/length_mean"),
    ("mismatch_k3", "mismatch k3 (trainer vs engine)", "mismatch/k3"),
    ("grad_norm", "gradient norm (before clipping)", "grad_norm"),
)
"""(file stem, title, metric of the RL rows)."""


def report_after_training(run_dir: str | Path) -> str:
    """The report at the end of ``train``: written when matplotlib is installed; the line to print."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return "report: skipped, the plots need matplotlib: pip install 'sapo-megatron[report]'"
    return f"report: {write_report(run_dir)}"


def read_rows(run_dir: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """Phase → step → the last row logged for it (torn lines skipped)."""
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl; give the output directory of a training run")
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            rows.setdefault(str(row["phase"]), {})[int(row["step"])] = row
        except (ValueError, KeyError, TypeError):
            continue
    return rows


def write_report(run_dir: str | Path) -> Path:
    """Write the PNGs and ``report.md`` into ``RUN_DIR/report``; returns the path of ``report.md``."""
    run_dir = Path(run_dir)
    rows = read_rows(run_dir)
    out = run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    rl = rows.get("rl", {})
    written = []
    for stem, title, metric in RL_PLOTS:
        _plot(out / f"{stem}.png", title, [{metric: _series(rl, metric)}], log=stem in LOG_SCALE)
        written.append(stem)
    panels = _eval_panels(rows.get("eval", {}))
    _plot(out / "eval.png", "evaluation (per dataset)", list(panels.values()), titles=list(panels))
    written.insert(1, "eval")
    summary = _read_json(run_dir / "summary.json")
    path = out / "report.md"
    path.write_text(_markdown(run_dir, summary, rl, written))
    return path


def _series(rows: dict[int, dict[str, Any]], metric: str) -> tuple[list[int], list[float]]:
    points = [(step, row[metric]) for step, row in sorted(rows.items()) if row.get(metric) is not None]
    return [p[0] for p in points], [float(p[1]) for p in points]


def _eval_panels(rows: dict[int, dict[str, Any]]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """Dataset → its curves (avg@n, pass@k, maj@n over the whole dataset, not per source)."""
    panels: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    keys = dict.fromkeys(key for row in rows.values() for key in row)
    for key in keys:
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and "@" in parts[2]:
            panels.setdefault(parts[1], {})[parts[2]] = _series(rows, key)
    return panels


def _plot(path: Path, title: str, panels, *, titles: list[str] | None = None, log: bool = False) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    count = max(len(panels), 1)
    figure = Figure(figsize=(FIGURE_SIZE[0] + 3.0 * (count - 1), FIGURE_SIZE[1]), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, count, squeeze=False)[0]
    for index, ax in enumerate(axes):
        curves = panels[index] if index < len(panels) else {}
        drawn = [v for _, values in curves.values() for v in values]
        for label, (steps, values) in curves.items():
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 12 else None, markersize=3, label=label)
        if not drawn:
            ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes)
        elif log and min(drawn) > 0:
            ax.set_yscale("log")
        if len(curves) > 1:
            ax.legend(fontsize=7, frameon=False)
        if titles:
            ax.set_title(titles[index], fontsize=9)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    figure.suptitle(title, fontsize=10)
    save_small_png(figure, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _headline_word(summary: dict[str, Any]) -> str:
    """``accuracy`` for 0/1 scores; ``mean score (not 0/1)`` for a graded reward."""
    datasets = (summary.get("eval") or {}).get("datasets") or {}
    first: Any = next(iter(datasets.values()), {})
    return (
        "mean score (not 0/1)" if isinstance(first, dict) and first.get("scores") == "graded" else "accuracy"
    )


def _markdown(run_dir: Path, summary: dict[str, Any] | None, rl: dict[int, dict], plots: list[str]) -> str:
    lines = [f"# Run report: {run_dir.name}", ""]
    if summary is None:
        lines += [f"Unfinished run: {len(rl)} RL steps logged, no summary.json yet.", ""]
    else:
        lines += [
            f"{summary.get('steps')} RL steps in {summary.get('wall_seconds')} s; {_headline_word(summary)} (first "
            f"eval dataset, avg@n) {_fmt(summary.get('accuracy_before'))} → {_fmt(summary.get('accuracy_after'))}.",
            "",
        ]
        lines += _eval_table(summary.get("eval"))
    lines += [f"![{stem}]({stem}.png)" for stem in plots]
    return "\n".join(lines) + "\n"


def _eval_table(last: dict[str, Any] | None) -> list[str]:
    if not last or not last.get("datasets"):
        return []
    datasets = last["datasets"]
    columns = sorted(
        dict.fromkeys(k for m in datasets.values() for k in m if "@" in k or k.endswith(("_frac", "_mean"))),
        key=_column_order,
    )
    lines = [
        f"Last evaluation (RL step {last['step']}):",
        "",
        "| dataset | prompts | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for name, metrics in datasets.items():
        cells = [_fmt(metrics.get(column)) for column in columns]
        lines.append(f"| {name} | {metrics['num_prompts']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _column_order(key: str) -> tuple[int, int]:
    """avg@n, pass@1, pass@2, ..., maj@n, then the rest (summary.json sorts keys alphabetically)."""
    name, _, k = key.partition("@")
    rank = {"avg": 0, "pass": 1, "maj": 2}.get(name, 3)
    return rank, int(k) if k.isdigit() else 0


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3f}"
