"""The hostile cases of issue 30 as tests: each case is one ``pytest.param`` made by :func:`case`, which records
its area, its name (as in ``hostile_cases.tsv``) and the class it is expected to have now.

``hostile_cases.tsv`` lists the cases with the class each had on main 19f5fae (2026-12-01). The table in
docs/hardening.md is derived from the expectations recorded here (``python -m tests.security.hostile``), and
``test_hostile_table.py`` checks that every case of the list is a test and that the page shows the derived table.

Classes: CLEAR (one-line error, non-zero exit), OK (valid or harmless input, handled as documented), WARN (a clear
warning, then it continues), UNCLEAR, TRACEBACK, HANG, SILENT, DATA-LOST, EXPOSURE (see the tsv's README).
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import io
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sapo_megatron.errors import UserError

CASES_TSV = Path(__file__).with_name("hostile_cases.tsv")
CASES_TSV_3 = Path(__file__).with_name("hostile_cases_3.tsv")
"""Round 3 (issue 39): the cases tried on main 3855bb6, with the class each had there."""
CLASSES = ("CLEAR", "OK", "WARN", "UNCLEAR", "TRACEBACK", "HANG", "SILENT", "DATA-LOST", "EXPOSURE")
AREAS = (
    "datasets",
    "templates/tokenizers",
    "rewards",
    "code_exec sandbox",
    "eval/report",
    "serve",
    "configs",
    "checkpoints",
)
AREAS_3 = (
    "sandbox namespaces",
    "verdicts",
    "tool output",
    "tools",
    "images",
    "reward conventions",
    "commands",
)
"""Round 3's areas (``hostile_cases_3.tsv``), a table of their own in docs/hardening.md."""
TEST_MODULES = (
    "tests.security.test_hostile_data",
    "tests.security.test_hostile_templates",
    "tests.security.test_hostile_rewards",
    "tests.security.test_hostile_eval",
    "tests.security.test_hostile_serve",
    "tests.security.test_hostile_configs",
    "tests.security.test_hostile_checkpoints",
    "tests.eval.test_run_settings",
    "tests.security.test_hostile_tool_output",
    "tests.security.test_hostile_sandbox",
    "tests.security.test_hostile_verdicts",
    "tests.security.test_hostile_tools",
    "tests.security.test_hostile_images",
    "tests.security.test_hostile_conventions",
    "tests.security.test_hostile_commands",
)
"""The modules whose :func:`case` calls make up the table (imported by :func:`derived_table`)."""

NOT_HERE: dict[tuple[str, str], str] = {
    **{
        ("checkpoints", name): "needs a trained Megatron checkpoint: tests/rl, tests/checkpoint and "
        "tests/security/test_damaged_files.py cover the refusal; not re-measured here"
        for name in (
            "resume with other hidden size",
            "resume with other expert count",
            "checkpoint dir symlinked into another run + pruning",
            "eval on checkpoints/ with that latest",
            "eval on truncated Megatron checkpoint",
            "convert truncated checkpoint",
        )
    },
}
"""Listed cases that are not a :func:`case` of the modules above, and why."""

SANDBOX = "code_exec sandbox"
SANDBOX_TESTS = ("tests/rewards/test_sandbox.py", "tests/rewards/test_code_exec.py")
"""Where the sandbox's cases are tests, each named as in the list and each asserting containment (its module
docstring: "each must now be contained (CLEAR)"): a sandbox case named there counts as CLEAR."""
SANDBOX_ALIASES = {
    "TCP 127.0.0.1 listener": "tcp to a listener on 127 0 0 1",
    "double-fork setsid daemon": "a double forked daemon dies with the run",
    "stdout flood": "output are bounded",
}
"""Sandbox cases whose test is named in other words (the test's name, as the alias)."""


def sandbox_expected() -> dict[tuple[str, str], str]:
    """(area, case) → CLEAR for each sandbox case that :data:`SANDBOX_TESTS` name (see there)."""
    root = Path(__file__).resolve().parents[2]
    text = _words(" ".join((root / path).read_text() for path in SANDBOX_TESTS))
    found = {}
    for area, name, _ in listed_cases():
        parts = re.split(r", | / ", SANDBOX_ALIASES.get(name, name))
        if area == SANDBOX and all(_words(part) in text for part in parts):
            found[(area, name)] = "CLEAR"
    return found


def _words(text: str) -> str:
    return "_" + re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") + "_"


EXPECTED: dict[tuple[str, str], str] = {}
"""(area, case) → the class the tests expect now; filled as the test modules are imported."""


def case(area: str, name: str, cls: str, *values: Any) -> Any:
    """A ``pytest.param`` of ``values`` for the hostile case ``name`` of ``area``, expected to be ``cls`` now."""
    assert area in (*AREAS, *AREAS_3) and cls in CLASSES, (area, cls)
    assert EXPECTED.setdefault((area, name), cls) == cls, f"{name!r} expected twice with different classes"
    return pytest.param(cls, *values, id=name)


def listed_cases(round_: int = 2) -> list[tuple[str, str, str]]:
    """``(area, case, class before)`` of ``hostile_cases.tsv`` (round 2, on 19f5fae) or of
    ``hostile_cases_3.tsv`` (round 3, on 3855bb6)."""
    with (CASES_TSV if round_ == 2 else CASES_TSV_3).open() as handle:
        rows = list(csv.reader(handle, delimiter="\t"))
    return [(area, name, cls) for area, name, cls in rows[1:]]


# ----------------------------------------------------------------------------------------------------------
# Asserting a class
# ----------------------------------------------------------------------------------------------------------


def expect(cls: str, action: Callable[[], Any], *words: str) -> Any:
    """Run ``action`` and check it behaves as ``cls``: CLEAR raises a :class:`UserError` whose one-line message
    (with its hint) holds ``words``; OK and WARN return (WARN: ``words`` are in what it wrote to stderr or the
    log). Returns what ``action`` returned, or the error."""
    if cls == "CLEAR":
        with pytest.raises(UserError) as caught:
            action()
        text = f"{caught.value} {caught.value.hint or ''}"
        # one line, or the config's "invalid configuration:" list of one line per problem
        assert str(caught.value).count("\n") <= 3, f"not a short message: {caught.value}"
        assert "Traceback" not in text
        for word in words:
            assert word in text, f"{word!r} not in {text!r}"
        return caught.value
    assert cls in ("OK", "WARN"), f"a test cannot expect {cls}"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), _captured_warnings() as warned:
        result = action()
    said = err.getvalue() + " ".join(warned)
    for word in words:
        assert word in said or word in repr(result), f"{word!r} not in {said!r} / {result!r:.200}"
    return result


@contextlib.contextmanager
def _captured_warnings() -> Iterator[list[str]]:
    import logging
    import warnings

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield lines
        lines.extend(str(w.message) for w in caught)
    finally:
        logging.getLogger().removeHandler(handler)


def expect_cli(cls: str, argv: list[str], capsys: Any, *words: str) -> str:
    """``sapo-megatron ARGV`` in this process: CLEAR exits non-zero with a short message holding ``words`` and no
    traceback; OK / WARN exit 0. Returns stdout + stderr."""
    from sapo_megatron.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code if isinstance(exit_.code, int) else 2
    out = capsys.readouterr()
    said = out.out + out.err
    assert "Traceback" not in said, said[-2000:]
    assert (code != 0) == (cls == "CLEAR"), f"exit {code} for {cls}: {said[-1000:]}"
    for word in words:
        assert word in said, f"{word!r} not in {said[-1500:]!r}"
    return said


# ----------------------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------------------


def derived_table(round_: int = 2) -> tuple[dict[str, Counter], list[tuple[str, str]]]:
    """Area → Counter of expected classes, over the listed cases of round ``round_``; and the listed cases no
    test expects (their old class is counted, so the table always covers every case)."""
    for module in TEST_MODULES:
        importlib.import_module(module)
    counts: dict[str, Counter] = {area: Counter() for area in (AREAS if round_ == 2 else AREAS_3)}
    untested = []
    expected = {**sandbox_expected(), **EXPECTED}
    for area, name, old in listed_cases(round_):
        now = expected.get((area, name))
        if now is None:
            untested.append((area, name))
        counts[area][now or old] += 1
    return counts, untested


def before_table(round_: int) -> dict[str, Counter]:
    """Area → Counter of the classes the listed cases had before the round's fixes."""
    counts: dict[str, Counter] = {area: Counter() for area in (AREAS if round_ == 2 else AREAS_3)}
    for area, _, old in listed_cases(round_):
        counts[area][old] += 1
    return counts


def markdown(counts: dict[str, Counter]) -> str:
    header = "| area | " + " | ".join(cls.lower() for cls in CLASSES) + " | total |"
    lines = [header, "|---" * (len(CLASSES) + 2) + "|"]
    for area in [*counts, "all"]:
        counter = sum(counts.values(), Counter()) if area == "all" else counts[area]
        cells = [str(counter[cls]) if counter[cls] else "–" for cls in CLASSES]
        lines.append(f"| {area} | " + " | ".join(cells) + f" | {sum(counter.values())} |")
    return "\n".join(lines)


if __name__ == "__main__":  # the registry filled by the test modules is the one of the importable module
    from tests.security import hostile

    table, missing = hostile.derived_table()
    print(hostile.markdown(table))
    table3, missing3 = hostile.derived_table(3)
    print("\nRound 3, before:\n" + hostile.markdown(hostile.before_table(3)))
    print("\nRound 3, now:\n" + hostile.markdown(table3))
    for area, name in [*missing, *missing3]:
        print(f"not a test yet (old class counted): {area}: {name}", file=sys.stderr)
