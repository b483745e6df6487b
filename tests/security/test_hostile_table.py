"""The table of hostile cases in docs/hardening.md is derived from the tests' expected classes, every listed case
is a test (or is named in ``NOT_HERE`` with the reason), and no case is expected to hang, crash, pass silently,
lose data or cross a boundary."""

from __future__ import annotations

from pathlib import Path

from tests.security import hostile

DOC = Path(__file__).resolve().parents[2] / "docs" / "hardening.md"
BAD = ("UNCLEAR", "TRACEBACK", "HANG", "SILENT", "DATA-LOST", "EXPOSURE")


def test_every_case_is_a_test_or_named_as_elsewhere():
    _, untested = hostile.derived_table()
    _, untested_3 = hostile.derived_table(3)
    assert set(untested) | set(untested_3) == set(hostile.NOT_HERE)
    listed = {(area, name) for round_ in (2, 3) for area, name, _ in hostile.listed_cases(round_)}
    assert set(hostile.EXPECTED) <= listed, (
        "a case() name that is not in hostile_cases.tsv / hostile_cases_3.tsv"
    )


def test_no_case_is_expected_to_be_bad():
    hostile.derived_table()
    assert not [key for key, cls in hostile.EXPECTED.items() if cls in BAD]


def test_every_sandbox_case_is_named_by_a_sandbox_test():
    sandbox = [(area, name) for area, name, _ in hostile.listed_cases() if area == hostile.SANDBOX]
    assert len(sandbox) == 31 and set(sandbox) == set(hostile.sandbox_expected())


def test_the_page_shows_the_derived_table():
    table, _ = hostile.derived_table()
    assert hostile.markdown(table) in DOC.read_text(), "regenerate it: python -m tests.security.hostile"


def test_the_page_shows_round_3_before_and_now():
    table, _ = hostile.derived_table(3)
    text = DOC.read_text()
    assert hostile.markdown(hostile.before_table(3)) in text, (
        "regenerate it: python -m tests.security.hostile"
    )
    assert hostile.markdown(table) in text, "regenerate it: python -m tests.security.hostile"


def test_round_3_cases_were_bad_before():
    """Every round-3 case is one the issue found wrong on 3855bb6 (none was clear or ok there)."""
    assert all(cls in BAD for _, _, cls in hostile.listed_cases(3))
