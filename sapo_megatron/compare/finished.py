"""``compare --runs DIR,DIR,...``: the comparison's report of runs that already finished, read from their run
directories (``metrics.jsonl``, ``summary.json``, ``config.yaml``) without training anything again."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from sapo_megatron.compare.arms import Arm, CompareError
from sapo_megatron.compare.report import ReportFiles, write_report


def run_arms(run_dirs: list[str]) -> dict[str, tuple[Arm, Path]]:
    """Arm name → (an arm labelled by the run's folder, the folder); :class:`CompareError` for a folder that
    holds no run. Links are resolved: a run named twice (a link to it, ``./a`` and ``a``) is one arm (a line
    says so); runs whose folders end alike are told apart by as many trailing folder names as it takes."""
    paths: dict[Path, str] = {}
    for text in run_dirs:
        path = Path(text)
        if not (path / "metrics.jsonl").is_file():
            raise CompareError(f"--runs {text}: not a run directory (no metrics.jsonl)")
        resolved = path.resolve()
        if resolved in paths:
            print(
                f"--runs: {text} is the run {paths[resolved]} again ({resolved}); reported once",
                file=sys.stderr,
            )
            continue
        paths[resolved] = text
    arms: dict[str, tuple[Arm, Path]] = {}
    for resolved, label in zip(paths, _labels(list(paths))):
        path = Path(paths[resolved])
        settings = _settings(path)
        arm = Arm(
            loss=settings["loss"],
            replay=settings["replay"],
            correction=settings["correction"],
            seed=0,
            label=label,
        )
        arms[arm.name] = (arm, path)
    return arms


def _labels(paths: list[Path]) -> list[str]:
    """A distinct label per path: its last folder name, with as many parent names as needed to tell it apart."""
    labels = []
    for path in paths:
        depth = 1
        while (
            depth < len(path.parts)
            and sum(other.parts[-depth:] == path.parts[-depth:] for other in paths) > 1
        ):
            depth += 1
        labels.append("-".join(part for part in path.parts[-depth:] if part != "/"))
    return labels


def _settings(run_dir: Path) -> dict[str, str]:
    """The run's loss, routing replay, correction and rewards from its ``config.yaml`` (``-`` where unknown)."""
    import yaml

    try:
        raw = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        raw = {}
    algorithm = raw.get("algorithm") if isinstance(raw, dict) else None
    algorithm = algorithm if isinstance(algorithm, dict) else {}

    def name_of(section: Any, default: str) -> str:
        return str(section.get("name", default)) if isinstance(section, dict) else default

    return {
        "loss": name_of(algorithm.get("loss"), "-"),
        "replay": str(algorithm.get("routing_replay", "-")),
        "correction": name_of(algorithm.get("correction"), "-"),
        "reward": _rewards(raw, algorithm),
    }


def _rewards(raw: Any, algorithm: dict[str, Any]) -> str:
    """The training reward, and the first eval dataset's where it differs (what the accuracy column scored)."""
    reward = algorithm.get("reward", "-")
    datasets = ((raw.get("eval") or {}).get("datasets") or []) if isinstance(raw, dict) else []
    first = datasets[0].get("reward") if datasets and isinstance(datasets[0], dict) else None
    text = str(reward)
    return text if first in (None, reward) else f"{text} (eval: {first})"


def reward_warning(run_dirs: dict[str, Path]) -> str | None:
    """One line when the runs were trained or evaluated with different rewards: their reward and accuracy
    columns then measure different things."""
    rewards = {name: _settings(path)["reward"] for name, path in run_dirs.items()}
    if len(set(rewards.values())) <= 1:
        return None
    listed = "; ".join(f"`{name}`: {reward}" for name, reward in rewards.items())
    return (
        f"**Warning: these runs used different rewards** ({listed}): their reward and held-out accuracy columns "
        "do not compare."
    )


def report_finished_runs(run_dirs: list[str], output_dir: str | Path) -> ReportFiles:
    """Write ``report.md``, ``report.json`` and the plots of the runs in ``run_dirs`` into ``output_dir``."""
    if len(run_dirs) < 1:
        raise CompareError("--runs needs at least one run directory (comma-separated)")
    arms = run_arms(run_dirs)
    header = ["Finished runs, reported as they are (nothing trained): " + ", ".join(map(str, run_dirs))]
    warning = reward_warning({name: path for name, (_, path) in arms.items()})
    if warning:
        import logging

        logging.getLogger(__name__).warning(warning.replace("**", ""))
        header.append(warning)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    return write_report(
        output_dir,
        [arm for arm, _ in arms.values()],
        header=header,
        run_dirs={name: path for name, (_, path) in arms.items()},
    )
