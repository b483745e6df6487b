"""PNG plots of the comparison: one file per quantity, RL step on x, the arms overlaid.

Drawn with matplotlib's object API on the Agg canvas (no pyplot, no display, no global figure state). An arm's
colour is its (loss, correction) pair (a config arm's: its name), its line style its routing replay (none solid,
r2 dashed, r3 dotted), so the replay effect of one loss reads as three styles of one colour. A configuration run
with several seeds is one curve, the mean over its seeds at each step, in a band from their minimum to their
maximum (27 overlaid curves would be unreadable). Non-finite or missing values are gaps. A quantity no arm logged
still gets its file, saying so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sapo_megatron.compare.results import ArmResult, by_configuration

PLOTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("reward", "reward (mean over the step's samples)", ("reward",)),
    ("accuracy", "held-out accuracy (first eval dataset's avg@n, report.md says n and T)", ("accuracy",)),
    ("entropy", "entropy (nats per token)", ("entropy",)),
    ("mismatch_k3", "mismatch k3 (trainer vs engine)", ("mismatch_k3",)),
    (
        "routing_agreement",
        "routing agreement with the engine",
        ("routing_agreement", "routing_agreement_live"),
    ),
    ("grad_norm", "gradient norm (before clipping)", ("grad_norm",)),
    ("reverse_kl", "student–teacher reverse KL (nats per token)", ("reverse_kl",)),
    ("ratio_tails", "token importance ratio tails (per step, response tokens)", ("ratio_p99_9", "ratio_max")),
    ("kl_old", "k3 between the updating and the old policy (policy/kl_old)", ("kl_old",)),
    (
        "sapo_gate",
        "SAPO gate mean per advantage sign (token-weighted per step)",
        ("gate_w_pos", "gate_w_neg"),
    ),
)
"""(file stem, title, series of :class:`ArmResult` drawn; two series are two panels). Then one
``eval_<dataset>.png`` per eval dataset of the runs (its avg@n and pass@n, two panels)."""

PANEL_TITLES = {
    "routing_agreement": "used in training",
    "routing_agreement_live": "live (trainer's own routing)",
    "ratio_p99_9": "99.9th percentile",
    "ratio_max": "maximum",
    "gate_w_pos": "positive advantage (w+)",
    "gate_w_neg": "negative advantage (w−)",
}
EVAL_PREFIX = "eval:"
"""Series ``eval:<dataset>`` / ``eval:<dataset>:pass``: an eval dataset's avg@n / pass@n at its evaluations."""
LINE_STYLES = {"none": "-", "r2": "--", "r3": ":"}
LOG_SCALE = ("mismatch_k3", "grad_norm", "kl_old", "ratio_p99_9", "ratio_max")
"""Quantities drawn on a log axis when every value is positive (they span orders of magnitude)."""
FIGURE_SIZE = (8.0, 3.6)
DPI = 100  # with a 128-colour palette: 10-80 KB per file


def write_plots(results: Sequence[ArmResult], plots_dir: str | Path) -> list[Path]:
    """Write ``<stem>.png`` of :data:`PLOTS` into ``plots_dir``; returns the paths in that order."""
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    colours = _colours(results)
    paths = []
    for stem, title, series in (*PLOTS, *_eval_plots(results)):
        path = plots_dir / f"{stem}.png"
        _draw(results, series, title, colours, path)
        paths.append(path)
    return paths


def _eval_plots(results: Sequence[ArmResult]) -> list[tuple[str, str, tuple[str, ...]]]:
    plots = []
    for name in dict.fromkeys(name for r in results for name in r.evals):
        curve = next(r.evals[name] for r in results if name in r.evals)
        panels = (f"{EVAL_PREFIX}{name}",) + ((f"{EVAL_PREFIX}{name}:pass",) if curve.pass_metric else ())
        title = f"eval dataset {name}: {curve.metric}" + (
            f" and {curve.pass_metric}" if curve.pass_metric else ""
        )
        plots.append((f"eval_{name.replace('/', '_')}", title, panels))  # a source: heldout/colour
    return plots


def _draw(results: Sequence[ArmResult], series: Sequence[str], title: str, colours, path: Path) -> None:
    from matplotlib.artist import Artist
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(FIGURE_SIZE[0] + 3.0 * (len(series) - 1), FIGURE_SIZE[1]), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(series), squeeze=False)[0]
    legend: dict[str, Artist] = {}  # label → handle, over every panel (one panel may lack an arm)
    for ax, name in zip(axes, series):
        if _panel(ax, results, name, colours):
            handles, labels = ax.get_legend_handles_labels()
            legend.update(zip(labels, handles))
        else:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.set_title(_panel_title(results, name), fontsize=9)
    figure.suptitle(title, fontsize=10)
    if legend:
        figure.legend(
            list(legend.values()), list(legend), loc="outside right center", fontsize=7, frameon=False
        )
    _save_small_png(figure, path)


def _save_small_png(figure, path: Path) -> None:
    """Save as a 128-colour palette PNG: anti-aliased noisy curves make a full-colour file several times larger
    for no visible gain. Written to a temporary sibling first, then renamed into place."""
    from PIL import Image  # a dependency of matplotlib

    figure.set_dpi(DPI)
    canvas = figure.canvas
    canvas.draw()
    image = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    tmp = path.with_name(f".{path.name}.tmp")
    image.convert("RGB").quantize(colors=128, method=Image.Quantize.FASTOCTREE).save(
        tmp, format="PNG", optimize=True
    )
    tmp.replace(path)


save_small_png = _save_small_png
"""Shared with a run's own report (:mod:`sapo_megatron.eval.report`)."""


def _panel(ax, results: Sequence[ArmResult], name: str, colours) -> bool:
    """Draw one series of every configuration into ``ax`` (one arm: its values; several seeds: their mean and
    min-max band); returns whether any value was drawn."""
    drawn: list[float] = []
    for arms in by_configuration(results).values():
        steps, per_step = _values_per_step(arms, name)
        if not steps:
            continue
        arm = arms[0].arm
        means = [sum(values) / len(values) if values else float("nan") for values in per_step]
        style = dict(color=colours[arm.colour_key], linewidth=1.2)
        label = arm.name if len(arms) == 1 else f"{arm.configuration} (mean of {len(arms)} seeds)"
        marker = "o" if name == "accuracy" or name.startswith(EVAL_PREFIX) or len(steps) < 12 else None
        ax.plot(
            steps, means, LINE_STYLES.get(arm.replay, "-."), marker=marker, markersize=3, label=label, **style
        )
        if len(arms) > 1:
            low = [min(values) if values else float("nan") for values in per_step]
            high = [max(values) if values else float("nan") for values in per_step]
            ax.fill_between(steps, low, high, color=style["color"], alpha=0.12, linewidth=0)
        drawn += [v for values in per_step for v in values]
    if drawn and name in LOG_SCALE and min(drawn) > 0:
        ax.set_yscale("log")
    return bool(drawn)


def _eval_series(name: str) -> tuple[str, bool] | None:
    """``eval:<dataset>`` → (dataset, False), ``eval:<dataset>:pass`` → (dataset, True); None for other series."""
    if not name.startswith(EVAL_PREFIX):
        return None
    dataset, _, kind = name[len(EVAL_PREFIX) :].partition(":")
    return dataset, kind == "pass"


def _panel_title(results: Sequence[ArmResult], name: str) -> str:
    series = _eval_series(name)
    if series is None:
        return PANEL_TITLES.get(name, name)
    dataset, pass_k = series
    curve = next(r.evals[dataset] for r in results if dataset in r.evals)
    return (curve.pass_metric or "") if pass_k else curve.metric


def _values_per_step(arms: Sequence[ArmResult], name: str) -> tuple[list[int], list[list[float]]]:
    """The steps of the configuration's seeds and the values they logged there (an empty list: a gap); no steps
    when nothing was logged."""
    by_step: dict[int, list[float]] = {}
    for result in arms:
        for step, value in zip(*_points(result, name)):
            by_step.setdefault(step, []).extend([] if value is None else [value])
    if not any(by_step.values()):
        return [], []
    steps = sorted(by_step)
    return steps, [by_step[step] for step in steps]


def _points(result: ArmResult, name: str) -> tuple[list[int], list[float | None]]:
    """Held-out accuracy is measured at step 0, at evaluation steps and after the last step; eval datasets at
    their evaluations; the rest per step."""
    series = _eval_series(name)
    if series is not None:
        curve = result.evals.get(series[0])
        if curve is None:
            return [], []
        return list(curve.steps), list(curve.pass_values if series[1] else curve.values)
    if name != "accuracy":
        return list(result.steps), list(result.series[name])
    points = {
        step: value for step, value in zip(result.steps, result.series["accuracy"]) if value is not None
    }
    summary = result.summary or {}
    if summary.get("accuracy_before") is not None:
        points[0] = summary["accuracy_before"]
    if summary.get("accuracy_after") is not None:
        points[result.completed_steps] = summary["accuracy_after"]
    steps = sorted(points)
    return steps, [points[step] for step in steps]


def _colours(results: Sequence[ArmResult]) -> dict[tuple[str, ...], str]:
    keys = list(dict.fromkeys(r.arm.colour_key for r in results))
    return {key: f"C{i % 10}" for i, key in enumerate(keys)}
