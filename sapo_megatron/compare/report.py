"""The comparison's report: ``report.json`` (a stable shape), ``report.md`` (a table, the plots and an automatic
reading) and one PNG per quantity under ``plots/`` with the arms overlaid.

Everything comes from each arm's run directory: ``metrics.jsonl`` (rows of phase ``rl``; a value may be
``null`` = not finite) and ``summary.json`` (held-out accuracy before and after RL; absent while the arm is
unfinished or when it failed). A metric an arm never logged (routing agreement before the trainer logs it, k3
without rollout log-probs) is ``null`` in ``report.json`` and "–" in the table, never an error.

Definitions (``report.json`` → ``arms[i].final``):

- ``reward``, ``entropy``, ``reverse_kl``: mean of ``reward/mean`` / ``entropy`` / ``opd/reverse_kl`` (the
  student–teacher reverse KL of runs with a teacher) over the last 10 % of the arm's logged RL steps (at least one
  step), ignoring null values;
- ``accuracy``: ``summary.json`` ``accuracy_after`` (the first eval dataset's avg@n after the last step; the
  report names its n and temperature, :func:`accuracy_label`);
- ``mismatch_k3``: mean of ``mismatch/k3`` over all steps; ``routing_agreement``: mean of
  ``routing/agreement_used``; ``routing_agreement_live``: mean of ``routing/agreement``;
- ``grad_norm_max``: the largest finite ``grad_norm``;
- the policy diagnostics (:data:`DIAGNOSTICS`, docs/losses.md): ``ratio_p99_9`` (mean over steps of the step's
  99.9th percentile of the token importance ratio), ``ratio_max`` (the largest ratio of the run), ``kl_old`` (mean
  ``policy/kl_old``, the k3 between the updating and the old policy), ``clip_frac`` (mean ``clip/frac``),
  ``gate_w_pos`` / ``gate_w_neg`` (mean SAPO gate over tokens of positive / negative advantage) and
  ``gate_seq_std`` (mean within-sequence standard deviation of the gate), ``m2po_masked`` (M2PO's dropped-token
  share) and ``rejected_frac`` (a ``rollout_corr`` correction's rejected-token share); null for a loss that logs none;
- ``collapsed``: :func:`collapse_reasons` is not empty (the rule is :data:`COLLAPSE_RULE`).

``arms[i].eval`` → per eval dataset (the run's ``eval`` section, rows of phase ``eval``): ``metric`` (its
headline, ``avg@n``), ``before`` (at RL step 0) and ``after`` (its last evaluation), ``pass_metric`` (``pass@n``)
and ``pass_after``; a dataset of several sources also has one entry per source, ``<name>/<source>`` (its
``avg@n``, no pass metric).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sapo_megatron import jsonio
from sapo_megatron.compare.arms import Arm, CompareError
from sapo_megatron.compare.results import ArmResult, EvalCurve, by_configuration

FINAL_FRACTION = 0.1
"""``final`` reward/entropy average the last 10 % of an arm's steps."""
DROP_FRACTION = 0.5
"""Collapse: reward or held-out accuracy ends below half of where it started..."""
MIN_START_LEVEL = 0.1
"""...when it started at 0.1 or more (a drop from near zero is noise, not a collapse)."""
GRAD_EXPLOSION = 20.0
"""Collapse: some step's gradient norm is 20× the median of the arm's non-zero gradient norms, or more."""

COLLAPSE_RULE = (
    "An arm **collapsed** when at least one of these holds: "
    "(1) a step logged a non-finite loss or gradient norm, or the run stopped on non-finite updates; "
    f"(2) its final reward (mean `reward/mean` over the last {FINAL_FRACTION:.0%} of steps) fell below "
    f"{DROP_FRACTION:.0%} of its reward at the first RL step (the starting policy's own samples), which was "
    f"{MIN_START_LEVEL} or more; "
    f"(3) its held-out accuracy after RL fell below {DROP_FRACTION:.0%} of its accuracy before RL, having "
    f"started at {MIN_START_LEVEL} or more; "
    f"(4) its gradient norm exploded: some step's `grad_norm` reached {GRAD_EXPLOSION:g}× the median of its "
    "non-zero gradient norms."
)

METRICS = {
    "reward": "reward/mean",
    "accuracy": "accuracy",
    "entropy": "entropy",
    "mismatch_k3": "mismatch/k3",
    "routing_agreement": "routing/agreement_used",
    "routing_agreement_live": "routing/agreement",
    "grad_norm": "grad_norm",
    "loss": "loss/total",
    "reverse_kl": "opd/reverse_kl",
}
"""Short name → metric name in ``metrics.jsonl``."""

DIAGNOSTICS = {
    "ratio_p99_9": "ratio/p99.9",
    "ratio_max": "ratio/max",
    "kl_old": "policy/kl_old",
    "clip_frac": "clip/frac",
    "gate_w_pos": "sapo/w_mean_pos",
    "gate_w_neg": "sapo/w_mean_neg",
    "gate_seq_std": "sapo/seq_w_std",
    "m2po_masked": "m2po/frac_masked",
    "rejected_frac": "rollout_corr/rejected_frac",
}
"""The policy diagnostics of each step (short name → metric name); ``final`` holds their mean over the steps,
except ``ratio_max`` (the largest)."""
METRICS.update(DIAGNOSTICS)

NO_MISMATCH_K3 = 1e-6
"""Below this mean k3 (fp32 engine and trainer agree to ~1e-7 in log-prob) the reading says there is no mismatch."""

NONFINITE_MARK = "non-finite"
"""A failure message holding this (the trainer's NonFiniteTrainingError says it) counts as collapse (1)."""


def load_arm_result(arm: Arm, run_dir: str | Path, failure: str | None = None) -> ArmResult:
    """Read one arm's run directory (it may be missing or partial) and compute its ``final`` values and
    collapse verdict."""
    run_dir = Path(run_dir)
    steps, series = read_rl_series(run_dir / "metrics.jsonl")
    summary = _read_json(run_dir / "summary.json")
    result = ArmResult(
        arm, run_dir, steps, series, summary, failure, evals=read_eval_curves(run_dir / "metrics.jsonl")
    )
    result.reasons = collapse_reasons(result)
    result.final = final_values(result)
    return result


def read_phase_rows(path: Path, phase: str) -> dict[int, dict[str, Any]]:
    """Step → the last row of ``phase`` in a ``metrics.jsonl`` (a resumed run logs a step again; torn lines are
    skipped)."""
    rows: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                if row.get("phase") == phase:
                    rows[int(row["step"])] = row
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    return rows


def read_eval_curves(path: Path) -> dict[str, EvalCurve]:
    """Each eval dataset's ``eval/<name>/avg@n`` and largest ``eval/<name>/pass@k`` over the eval rows; and, for a
    dataset of several sources, each source's ``eval/<name>/<source>/avg@n`` as the curve ``<name>/<source>``
    (its avg@n only: a pass@k column per source would crowd the table)."""
    rows = read_phase_rows(path, "eval")
    steps = sorted(rows)
    metrics: dict[str, dict[str, int]] = {}  # dataset → {"avg": n, "pass": k}
    sources: dict[str, set[str]] = {}  # dataset → its sources
    for row in rows.values():
        for key in row:
            parts = key.split("/")
            if len(parts) not in (3, 4) or parts[0] != "eval" or "@" not in parts[-1]:
                continue
            kind, _, k = parts[-1].partition("@")
            if len(parts) == 4:
                if kind == "avg":
                    sources.setdefault(parts[1], set()).add(parts[2])
            elif kind in ("avg", "pass") and k.isdigit():
                best = metrics.setdefault(parts[1], {})
                best[kind] = max(best.get(kind, 0), int(k))
    curves = {}
    for name, best in metrics.items():
        if "avg" not in best:
            continue
        metric = f"avg@{best['avg']}"
        pass_metric = f"pass@{best['pass']}" if "pass" in best else None
        curves[name] = _curve(rows, steps, f"eval/{name}", metric, pass_metric)
        if len(sources.get(name, ())) > 1:
            for source in sorted(sources[name]):
                curves[f"{name}/{source}"] = _curve(rows, steps, f"eval/{name}/{source}", metric, None)
    return curves


def _curve(
    rows: Mapping[int, Mapping[str, Any]],
    steps: Sequence[int],
    prefix: str,
    metric: str,
    pass_metric: str | None,
) -> EvalCurve:
    mine = [step for step in steps if f"{prefix}/{metric}" in rows[step]]
    return EvalCurve(
        metric,
        pass_metric,
        tuple(mine),
        tuple(_number(rows[step][f"{prefix}/{metric}"]) for step in mine),
        tuple(_number(rows[step].get(f"{prefix}/{pass_metric}")) for step in mine) if pass_metric else (),
    )


def read_rl_series(path: Path) -> tuple[list[int], dict[str, list[float | None]]]:
    """The RL rows of a ``metrics.jsonl`` as per-step series of :data:`METRICS` (torn lines are skipped)."""
    rows = read_phase_rows(path, "rl")
    steps = sorted(rows)
    series = {short: [_number(rows[step].get(name)) for step in steps] for short, name in METRICS.items()}
    # A logged key whose value is null was not finite; tell it apart from a key never logged.
    series["nonfinite"] = [
        float(any(name in rows[step] and rows[step][name] is None for name in ("loss/total", "grad_norm")))
        for step in steps
    ]
    return steps, series


def final_values(result: ArmResult) -> dict[str, Any]:
    """The ``final`` mapping of ``report.json`` (see the module docstring)."""
    window = _window(len(result.steps))
    return {
        "reward": _mean(result.series["reward"][-window:] if window else []),
        "accuracy": (result.summary or {}).get("accuracy_after"),
        "entropy": _mean(result.series["entropy"][-window:] if window else []),
        "mismatch_k3": _mean(result.series["mismatch_k3"]),
        "routing_agreement": _mean(result.series["routing_agreement"]),
        "routing_agreement_live": _mean(result.series["routing_agreement_live"]),
        "grad_norm_max": _max(result.series["grad_norm"]),
        "reverse_kl": _mean(result.series["reverse_kl"][-window:] if window else []),
        **{short: (_max if short == "ratio_max" else _mean)(result.series[short]) for short in DIAGNOSTICS},
        "collapsed": bool(result.reasons),
    }


def collapse_reasons(result: ArmResult) -> list[str]:
    """Which parts of :data:`COLLAPSE_RULE` the arm meets, each with its numbers; empty: not collapsed."""
    reasons = []
    bad_steps = [step for step, bad in zip(result.steps, result.series["nonfinite"]) if bad]
    if bad_steps:
        reasons.append(f"non-finite loss or gradient norm at step {bad_steps[0]}")
    elif result.failure and NONFINITE_MARK in result.failure:
        reasons.append("stopped on non-finite updates")
    # The first step's reward is the starting policy's (its rollout precedes any update); a window over the
    # first steps would already average in a collapse that happens within a few steps.
    start = next((value for value in result.series["reward"] if value is not None), None)
    window = _window(len(result.steps))
    end = _mean(result.series["reward"][-window:]) if window else None
    if _dropped(start, end):
        reasons.append(f"reward {start:.3g} → {end:.3g}")
    summary = result.summary or {}
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    if _dropped(before, after):
        reasons.append(f"held-out accuracy {before:.3g} → {after:.3g}")
    norms = [value for value in result.series["grad_norm"] if value is not None]
    nonzero = [value for value in norms if value > 0]
    if nonzero and max(norms) >= GRAD_EXPLOSION * statistics.median(nonzero):
        reasons.append(
            f"gradient norm {max(norms):.3g} ≥ {GRAD_EXPLOSION:g}× median {statistics.median(nonzero):.3g}"
        )
    return reasons


def _dropped(start: float | None, end: float | None) -> bool:
    return start is not None and end is not None and start >= MIN_START_LEVEL and end < DROP_FRACTION * start


def _window(num_steps: int) -> int:
    return max(1, math.ceil(FINAL_FRACTION * num_steps)) if num_steps else 0


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _mean(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return sum(present) / len(present) if present else None


def _max(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return max(present) if present else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# --------------------------------------------------------------------------------------------------------
# report.json and report.md
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportFiles:
    markdown: Path
    json: Path
    plots: tuple[Path, ...]


def report_json(results: Sequence[ArmResult]) -> dict[str, Any]:
    """The stable shape: ``{"arms": [{name, loss, replay, correction, seed, overrides, run_dir, steps,
    final: {...}, eval: {...}}]}``; ``overrides`` holds the arm's ``--grid`` point (dotted key → value, {} without a grid)."""
    return {
        "arms": [
            {
                "name": r.arm.name,
                "loss": r.arm.loss,
                "replay": r.arm.replay,
                "correction": r.arm.correction,
                "seed": r.arm.seed,
                "overrides": dict(r.arm.grid),
                "run_dir": str(r.run_dir),
                "steps": r.completed_steps,
                "final": r.final,
                "eval": {name: curve.summary() for name, curve in r.evals.items()},
            }
            for r in results
        ]
    }


def write_report(
    output_dir: str | Path,
    arms: Sequence[Arm],
    *,
    failures: Mapping[str, str] | None = None,
    header: Sequence[str] = (),
    run_dirs: Mapping[str, Path] | None = None,
) -> ReportFiles:
    """Read the arms' run directories ``output_dir/<arm.name>`` and write ``report.json``, ``report.md`` and
    ``plots/*.png`` into ``output_dir``. ``failures``: arm name → error line of arms whose run failed;
    ``header``: lines that describe the comparison (shown first in ``report.md``); ``run_dirs``: arm name → its run
    directory, where it is not ``output_dir/<arm.name>`` (``compare --runs``)."""
    require_matplotlib()
    output_dir = Path(output_dir)
    failures = failures or {}
    where = run_dirs or {}
    results = [
        load_arm_result(arm, where.get(arm.name, output_dir / arm.name), failures.get(arm.name))
        for arm in arms
    ]
    from sapo_megatron.compare.plots import write_plots

    plots = write_plots(results, output_dir / "plots")
    json_path = _write_text(output_dir / "report.json", jsonio.dumps(report_json(results), indent=2) + "\n")
    markdown = render_markdown(results, plots=[p.relative_to(output_dir) for p in plots], header=header)
    md_path = _write_text(output_dir / "report.md", markdown)
    return ReportFiles(md_path, json_path, tuple(plots))


def require_matplotlib() -> None:
    """Raise :class:`CompareError` with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CompareError(
            "the compare report draws its plots with matplotlib, which is not installed",
            hint="pip install 'sapo-megatron[report]' (or: pip install 'matplotlib>=3.8')",
        ) from None


def render_markdown(
    results: Sequence[ArmResult], *, plots: Sequence[Path], header: Sequence[str] = ()
) -> str:
    lines = ["# sapo-megatron compare", "", *header, ""] if header else ["# sapo-megatron compare", ""]
    lines += [
        "## Results",
        "",
        *_table(results),
        "",
        _DEFINITIONS.format(accuracy=accuracy_label(results)),
        "",
    ]
    lines += ["## By configuration", "", *configuration_table(results), "", _CONFIGURATION_NOTE, ""]
    lines += ["## Reading (automatic)", "", *[f"- {line}" for line in reading(results)], ""]
    lines += ["## Collapse rule", "", COLLAPSE_RULE, ""]
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{path.stem}]({path.as_posix()})" for path in plots]
        lines.append("")
    return "\n".join(lines)


_DEFINITIONS = (
    f"reward, entropy, reverse KL (student–teacher): mean over the last {FINAL_FRACTION:.0%} of the RL steps; "
    "held-out accuracy: {accuracy}, before "
    "the first and after the last RL step; k3 and routing agreement: mean over all steps (agreement used: the "
    "routing of the training forward vs the engine's; live: the trainer's own routing vs the engine's); "
    "–: not logged by the run."
)


def measured_as(run_dir: Path) -> str | None:
    """What a run's held-out accuracy (``summary.json``'s, its first eval dataset's avg@n) measured, from its
    ``config.yaml``: ``"avg@4 of heldout (n 4, T 1)"``; None without one."""
    import yaml

    try:
        raw = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        section = raw.get("eval") or {}
        dataset, defaults = section["datasets"][0], section.get("defaults") or {}
    except (OSError, yaml.YAMLError, KeyError, IndexError, TypeError, AttributeError):
        return None

    def pick(key: str, default: Any) -> Any:
        for value in (dataset.get(key), defaults.get(key)):
            if value is not None:
                return value
        return default

    n, temperature = pick("n", 1), pick("temperature", 0.0)
    return (
        f"avg@{n} of {dataset.get('name')} (n {n}, T {temperature:g}{', greedy' if temperature == 0 else ''})"
    )


def accuracy_label(results: Sequence[ArmResult]) -> str:
    """What the held-out accuracy column measured: one description when the arms agree, else one per arm."""
    labels = {r.arm.name: measured_as(r.run_dir) or "unknown (no config.yaml)" for r in results}
    distinct = set(labels.values())
    if len(distinct) == 1:
        return distinct.pop()
    return "; ".join(f"`{name}` {label}" for name, label in labels.items())


def _table(results: Sequence[ArmResult]) -> list[str]:
    head = (
        "| arm | status | steps | reward | held-out accuracy | entropy | mismatch k3 | "
        "routing agreement used / live | max grad norm | reverse KL | collapsed |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        final, summary = r.final, r.summary or {}
        accuracy = f"{_fmt(summary.get('accuracy_before'))} → {_fmt(final['accuracy'])}"
        routing = f"{_fmt(final['routing_agreement'])} / {_fmt(final['routing_agreement_live'])}"
        collapsed = f"**yes**: {'; '.join(r.reasons)}" if r.reasons else "no"
        rows.append(
            f"| `{r.arm.name}` | {r.status} | {r.completed_steps} | {_fmt(final['reward'])} | "
            f"{accuracy} | {_fmt(final['entropy'])} | {_fmt(final['mismatch_k3'])} | {routing} | "
            f"{_fmt(final['grad_norm_max'])} | {_fmt(final['reverse_kl'])} | {collapsed} |"
        )
    return rows


_CONFIGURATION_NOTE = (
    "Each configuration's seeds: mean over its finished seeds (± their standard deviation when there are "
    "several); reward: at the first RL step → over the last 10 % of steps; eval datasets: at RL step 0 → at "
    "the last evaluation; ratio p99.9, kl_old, clip fraction and the SAPO gate (w+ / w−: tokens of positive / "
    "negative advantage; std in seq: within a sequence): mean over the steps; ratio max: the largest of the run; "
    "columns no arm logged are left out."
)

Column = tuple[str, Callable[[Sequence[ArmResult]], str]]


def configuration_table(results: Sequence[ArmResult]) -> list[str]:
    """One row per configuration (its seeds together): the headline numbers, every eval dataset and the
    policy diagnostics (see :data:`_CONFIGURATION_NOTE`)."""
    groups = by_configuration(results)
    columns = [
        c for c in _configuration_columns(results) if any(c[1](arms) != "–" for arms in groups.values())
    ]
    head = "| configuration | seeds | collapsed | " + " | ".join(title for title, _ in columns) + " |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for configuration, arms in groups.items():
        finished = [r for r in arms if r.status == "finished"]
        cells = [
            f"`{configuration}`",
            f"{len(finished)}/{len(arms)}",
            f"{sum(bool(r.reasons) for r in arms)}",
        ]
        rows.append("| " + " | ".join(cells + [cell(finished) for _, cell in columns]) + " |")
    return rows


def _configuration_columns(results: Sequence[ArmResult]) -> list[Column]:
    def first_reward(r: ArmResult) -> float | None:
        return next((v for v in r.series["reward"] if v is not None), None)

    columns: list[Column] = [
        (
            "reward",
            lambda arms: f"{_spread(map(first_reward, arms))} → {_spread(r.final['reward'] for r in arms)}",
        )
    ]
    datasets = list(dict.fromkeys(name for r in results for name in r.evals))
    for name in datasets:
        curves = [r.evals[name] for r in results if name in r.evals]
        metric, pass_metric = curves[0].metric, curves[0].pass_metric
        columns.append((f"{name} {metric}", _eval_cell(name, "before", "after")))
        if pass_metric and pass_metric != "pass@1":
            columns.append((f"{name} {pass_metric}", _eval_cell(name, None, "pass_after")))
    columns += [
        ("entropy", lambda arms: _spread(r.final["entropy"] for r in arms)),
        ("reverse KL", lambda arms: _spread(r.final["reverse_kl"] for r in arms)),
        ("ratio p99.9", lambda arms: _spread(r.final["ratio_p99_9"] for r in arms)),
        ("ratio max", lambda arms: _fmt(_max([r.final["ratio_max"] for r in arms]))),
        ("kl_old", lambda arms: _spread(r.final["kl_old"] for r in arms)),
        ("clip frac", lambda arms: _spread(r.final["clip_frac"] for r in arms)),
        (
            "gate w+ / w−",
            lambda arms: _pair(
                _spread(r.final["gate_w_pos"] for r in arms), _spread(r.final["gate_w_neg"] for r in arms)
            ),
        ),
        ("gate std in seq", lambda arms: _spread(r.final["gate_seq_std"] for r in arms)),
        ("M2PO masked", lambda arms: _spread(r.final["m2po_masked"] for r in arms)),
        ("rejected (rollout_corr)", lambda arms: _spread(r.final["rejected_frac"] for r in arms)),
    ]
    return columns


def _eval_cell(name: str, before: str | None, after: str) -> Callable[[Sequence[ArmResult]], str]:
    def cell(arms: Sequence[ArmResult]) -> str:
        summaries = [r.evals[name].summary() for r in arms if name in r.evals]
        end = _spread(s[after] for s in summaries)
        if before is None:
            return end
        start = _mean([s[before] for s in summaries])
        return "–" if start is None and end == "–" else f"{_fmt(start)} → {end}"

    return cell


def _pair(first: str, second: str) -> str:
    return "–" if first == second == "–" else f"{first} / {second}"


def _spread(values: Iterable[float | None]) -> str:
    """``mean ± sd`` over the values present (``mean`` alone for one; – for none)."""
    present = [v for v in values if v is not None]
    if not present:
        return "–"
    if len(present) == 1:
        return _fmt(present[0])
    return f"{_fmt(statistics.fmean(present))} ± {_fmt(statistics.stdev(present))}"


def reading(results: Sequence[ArmResult]) -> list[str]:
    """A few sentences anyone can check against the table: collapses, per-loss counts, the best arm, whether a
    mismatch source was active, and metrics missing."""
    lines = [_collapse_line(results)]
    losses = list(dict.fromkeys(r.arm.loss for r in results))
    for loss in losses:
        mine = [r for r in results if r.arm.loss == loss]
        by_replay = ", ".join(
            f"{replay} {sum(bool(r.reasons) for r in mine if r.arm.replay == replay)}/"
            f"{sum(r.arm.replay == replay for r in mine)}"
            for replay in dict.fromkeys(r.arm.replay for r in mine)
        )
        lines.append(
            f"{loss}: collapsed in {sum(bool(r.reasons) for r in mine)} of {len(mine)} arms ({by_replay})."
        )
    lines.append(_best_line(results))
    lines.append(_distillation_line(results))
    lines.append(_mismatch_line(results))
    lines += _missing_lines(results)
    return [line for line in lines if line]


def _collapse_line(results: Sequence[ArmResult]) -> str:
    collapsed = [r for r in results if r.reasons]
    if not collapsed:
        return "No arm collapsed by the rule below."
    return "Collapsed: " + "; ".join(f"`{r.arm.name}` ({', '.join(r.reasons)})" for r in collapsed) + "."


def _best_line(results: Sequence[ArmResult]) -> str:
    scored = [r for r in results if r.final["accuracy"] is not None]
    if not scored:
        return "No arm has finished, so there is no held-out accuracy to rank."
    best = max(scored, key=lambda r: r.final["accuracy"])
    ties = [r.arm.name for r in scored if r.final["accuracy"] == best.final["accuracy"]]
    names = ", ".join(f"`{name}`" for name in ties)
    return f"Highest held-out accuracy after RL: {_fmt(best.final['accuracy'])} ({names})."


def _distillation_line(results: Sequence[ArmResult]) -> str:
    """Entropy and reverse KL at the end, per arm, when some arm had a teacher (what OPD / SAF change)."""
    if all(r.final["reverse_kl"] is None for r in results):
        return ""
    parts = [
        f"`{r.arm.name}` entropy {_fmt(r.final['entropy'])}, reverse KL {_fmt(r.final['reverse_kl'])}"
        for r in results
    ]
    return "At the end (last 10 % of steps): " + "; ".join(parts) + "."


def _mismatch_line(results: Sequence[ArmResult]) -> str:
    k3 = [r.final["mismatch_k3"] for r in results if r.final["mismatch_k3"] is not None]
    if not k3:
        return "No arm logged `mismatch/k3` (the engine returned no log-probs)."
    if max(k3) < NO_MISMATCH_K3:
        return (
            f"Mismatch k3 is below {NO_MISMATCH_K3:g} in every arm: the engine and the trainer agree, so there is "
            "little for routing replay or a correction to fix (a mismatch source such as rollout.precision: fp8 "
            "makes one)."
        )
    return f"Mismatch k3 ranges from {min(k3):.3g} to {max(k3):.3g} across arms."


def _missing_lines(results: Sequence[ArmResult]) -> list[str]:
    lines = []
    if all(r.final["routing_agreement_live"] is None for r in results):
        lines.append(
            "No arm logged `routing/agreement` (the live routing agreement): its columns and plot are empty."
        )
    silent = [
        r.arm.name
        for r in results
        if r.arm.replay != "none" and r.steps and r.final["routing_agreement"] is None
    ]
    if silent:
        lines.append(
            "Arms with routing replay that logged no `routing/agreement_used`, so nothing shows the replay acted: "
            + ", ".join(f"`{name}`" for name in silent)
            + "."
        )
    unfinished = [r for r in results if r.status != "finished"]
    if unfinished:
        lines.append(
            "Not finished: "
            + ", ".join(
                f"`{r.arm.name}` ({r.status}{': ' + r.failure if r.failure else ''})" for r in unfinished
            )
            + "."
        )
    return lines


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:.3f}".rstrip("0").rstrip(".") if value != 0 else "0"
    return f"{value:.2e}"


def _write_text(path: Path, text: str) -> Path:
    """Write atomically (a temporary sibling renamed into place), so a reader never sees half a report."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
