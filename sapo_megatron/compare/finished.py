"""``compare --runs DIR,DIR,...``: the comparison's report of runs that already finished, read from their run
directories (``metrics.jsonl``, ``summary.json``, ``config.yaml``) without training anything again."""

from __future__ import annotations

from pathlib import Path

from sapo_megatron.compare.arms import Arm, CompareError
from sapo_megatron.compare.report import ReportFiles, write_report


def run_arms(run_dirs: list[str]) -> dict[str, tuple[Arm, Path]]:
    """Arm name → (an arm labelled by the run's folder name, the folder); :class:`CompareError` for a folder
    that holds no run."""
    arms: dict[str, tuple[Arm, Path]] = {}
    for text in run_dirs:
        path = Path(text)
        if not (path / "metrics.jsonl").is_file():
            raise CompareError(f"--runs {text}: not a run directory (no metrics.jsonl)")
        label = path.resolve().name
        if any(arm.label == label for arm, _ in arms.values()):
            label = f"{path.resolve().parent.name}-{label}"  # two runs/…/a folders: keep both
        arm = Arm(loss="-", replay="-", correction="-", seed=0, label=label)
        arms[arm.name] = (arm, path)
    return arms


def report_finished_runs(run_dirs: list[str], output_dir: str | Path) -> ReportFiles:
    """Write ``report.md``, ``report.json`` and the plots of the runs in ``run_dirs`` into ``output_dir``."""
    if len(run_dirs) < 1:
        raise CompareError("--runs needs at least one run directory (comma-separated)")
    arms = run_arms(run_dirs)
    header = ["Finished runs, reported as they are (nothing trained): " + ", ".join(map(str, run_dirs))]
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    return write_report(
        output_dir,
        [arm for arm, _ in arms.values()],
        header=header,
        run_dirs={name: path for name, (_, path) in arms.items()},
    )
