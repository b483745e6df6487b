"""Where the test suite's time goes: seconds per test directory, and the slowest tests, from one pytest run.

    python tools/test_times.py RUN.txt          # the output of `pytest --durations=0 -vv` (or --durations=N)
    python tools/test_times.py RUN.xml          # a `pytest --junitxml=RUN.xml` report
    python tools/test_times.py .test-times/*.xml   # what the last `make test` wrote (several reports add up)
        [--top 15] [--depth 2 | --files] [--unmarked-over S]

A directory is ``tests/<dir>`` (``--depth 2``; ``tests`` for the files at its top); setup, call and teardown
count toward the test's file. ``--durations`` hides entries under 0.005 s (``-vv`` shows them), so the sums are
at most a few seconds short. With ``--unmarked-over S`` it also lists the tests over ``S`` seconds whose file
has no ``slow`` marker, the candidates to mark (``make test-fast`` skips ``slow`` tests; tests/README.md).
The wall time of the run (pytest's last line) is printed with the sum: with ``-n 2`` (pytest-xdist) the sum is
about twice the wall time.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(setup|call|teardown)\s+(\S+?)(?:::(\S.*))?\s*$")
WALL = re.compile(r"in (\d+(?:\.\d+)?)s(?: \((\d+:\d\d:\d\d)\))?\s*=*\s*$")
REPO = Path(__file__).resolve().parents[1]


def read_durations(path: Path) -> tuple[dict[str, float], float | None]:
    """Test id → seconds (setup + call + teardown), and the run's wall time when the file says."""
    text = path.read_text(errors="replace")
    if path.suffix == ".xml":
        return _read_junit(text), None
    per_test: dict[str, float] = defaultdict(float)
    wall = None
    for line in text.splitlines():
        match = DURATION.match(line)
        if match:
            seconds, _phase, file, name = match.groups()
            per_test[f"{file}::{name}" if name else file] += float(seconds)
        elif (found := WALL.search(line)) and ("passed" in line or "failed" in line):
            wall = float(found.group(1))
    return dict(per_test), wall


def _read_junit(text: str) -> dict[str, float]:
    per_test: dict[str, float] = defaultdict(float)
    for case in ET.fromstring(text).iter("testcase"):
        classname = case.get("classname", "")
        file = case.get("file") or classname.replace(".", "/") + ".py"
        if not case.get("file") and not (REPO / file).is_file():  # classname = module.Class
            file = "/".join(classname.split(".")[:-1]) + ".py"
        per_test[f"{file}::{case.get('name')}"] += float(case.get("time", 0))
    return dict(per_test)


def directory_of(test_id: str, depth: int | None) -> str:
    """``tests/<dir>`` of a test id (``depth`` path components), or its file when ``depth`` is ``None``."""
    file = test_id.split("::")[0]
    if depth is None:
        return file
    return "/".join(file.split("/")[:-1][:depth]) or "."


def marked_slow(file: str) -> bool:
    """Whether the test file marks its tests (or some of them) ``slow``; a cheap textual check."""
    path = REPO / file
    return path.is_file() and "mark.slow" in path.read_text(errors="replace")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "reports", type=Path, nargs="+", help="pytest --durations=0 output, or --junitxml files"
    )
    parser.add_argument("--top", type=int, default=15, help="slowest tests to list (default: 15)")
    parser.add_argument("--depth", type=int, default=2, help="path components of a directory (default: 2)")
    parser.add_argument("--files", action="store_true", help="time per test file instead of per directory")
    parser.add_argument(
        "--unmarked-over", type=float, default=None, metavar="S", help="list unmarked tests over S seconds"
    )
    args = parser.parse_args()
    per_test, wall = {}, None
    for report in args.reports:
        found, report_wall = read_durations(report)
        if not found:
            print(f"{report}: no durations found (run pytest with --durations=0)", file=sys.stderr)
            return 1
        per_test.update(found)
        wall = report_wall if wall is None else wall + (report_wall or 0.0)
    per_dir: dict[str, list[float]] = defaultdict(list)
    for test_id, seconds in per_test.items():
        per_dir[directory_of(test_id, None if args.files else args.depth)].append(seconds)
    total = sum(per_test.values())
    width = max(len(name) for name in [*per_dir, "directory"])
    print(f"{'file' if args.files else 'directory':<{width}} {'tests':>6} {'seconds':>9} {'share':>6}")
    for name, times in sorted(per_dir.items(), key=lambda item: -sum(item[1])):
        print(f"{name:<{width}} {len(times):>6} {sum(times):>9.1f} {sum(times) / total:>6.1%}")
    wall_text = f", wall {wall:.0f} s" if wall is not None else ""
    print(f"{'total':<{width}} {len(per_test):>6} {total:>9.1f}{wall_text}")
    print(f"\nslowest {args.top}:")
    for test_id, seconds in sorted(per_test.items(), key=lambda item: -item[1])[: args.top]:
        print(f"{seconds:8.1f} s  {test_id}")
    if args.unmarked_over is not None:
        unmarked = [
            (seconds, test_id)
            for test_id, seconds in per_test.items()
            if seconds > args.unmarked_over and not marked_slow(test_id.split("::")[0])
        ]
        print(f"\nover {args.unmarked_over:g} s in files without a slow marker: {len(unmarked)}")
        for seconds, test_id in sorted(unmarked, reverse=True):
            print(f"{seconds:8.1f} s  {test_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
