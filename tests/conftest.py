"""Suite-wide test settings: which tests are ``slow`` (skipped by ``make test-fast``), how tests share a
pytest-xdist run, and a reminder at the end of a fast run of the tests that should be marked slow.

- ``slow``: a test that starts processes (ranks, servers, the CLI) or trains a model end to end. Mark it with
  ``@pytest.mark.slow`` (or ``pytestmark = pytest.mark.slow`` for a whole file); every test under a directory
  of :data:`SLOW_PATHS` is slow without a mark. ``make test`` runs all tests; ``make test-fast`` runs
  ``-m "not slow"`` and, at its end, lists unmarked tests that took longer than :data:`FAST_BUDGET_S`.
- pytest-xdist (``make test`` runs ``-n 2 --dist loadfile``): the tests of one file stay on one worker (module
  fixtures are built once). The Slurm tests (tests/launch) share one test cluster, so ``make test`` runs them in
  a pytest of their own after the rest. (``--dist loadgroup`` would be the tool, but pytest-xdist 3.8 writes its
  group into ``Item._nodeid``, which pytest 9.2's ``nodeid`` no longer reads: the groups are silently ignored.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SLOW_PATHS = (
    "rl/",
    "launch/",
    "megatron/test_nonfinite.py",
    "megatron/test_packing_layouts.py",
    "megatron/test_parallel_layouts.py",
    "megatron/test_process_group_timeout.py",
    "megatron/test_routing_replay.py",
    "rollout/test_router.py",
    "rollout/test_server_load.py",
    "rollout/test_weight_sync_layouts.py",
    "checkpoint/test_layouts.py",
    "compare/test_end_to_end.py",
    "distill/test_loop.py",
    "loss/test_megatron_hook.py",
    "data/test_recipe.py",
    "eval/test_eval_command.py",
    "rewards/test_training.py",
    "security/test_interrupted_sync.py",
    "sglang_real/",
    "test_interrupts.py",
    "test_gpu_check.py::test_checks_run_on_cpu_and_report_a_table",
    "test_rollout_pipeline.py::test_only_the_main_rank_generates_and_a_failure_there_reaches_every_rank",
)
"""Tests under tests/ that are slow without a mark, by path prefix: a directory (``rl/``: also every new file
in it), a file, or one test (``file.py::name``). Chosen from a ``--durations=0`` run (tools/test_times.py):
multi-process layouts, end-to-end runs, real servers and launchers."""

FAST_BUDGET_S = 8.0
"""A test without the ``slow`` mark that takes longer than this is listed at the end of a fast run."""


def _relative(item: pytest.Item) -> str:
    """``file.py::name[param]`` of a test, relative to tests/ (empty for a test outside it)."""
    try:
        path = Path(item.fspath).resolve().relative_to(TESTS).as_posix()
    except ValueError:  # a test outside tests/ (given on the command line)
        return ""
    return f"{path}::{item.name}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = _relative(item)
        if any(path.startswith(slow) for slow in SLOW_PATHS):
            item.add_marker(pytest.mark.slow)


_over_budget: list[tuple[float, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.duration > FAST_BUDGET_S and "slow" not in report.keywords:
        _over_budget.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _over_budget:
        return
    terminalreporter.section("tests to mark slow")
    terminalreporter.write_line(
        f"these tests have no slow mark and took over {FAST_BUDGET_S:g} s (tests/conftest.py says how to mark):"
    )
    for duration, nodeid in sorted(_over_budget, reverse=True):
        terminalreporter.write_line(f"{duration:7.1f} s  {nodeid}")


@pytest.fixture(scope="module")
def isolated() -> dict:
    """The code sandbox's isolation report; its namespaces need root with CAP_SYS_ADMIN. As root (CI) a missing
    isolation fails; elsewhere the tests that take this fixture skip (the fallback: tests/rewards/test_code_exec.py)."""
    import os

    from sapo_megatron.rewards.sandbox import ISOLATED, isolation

    found = isolation()
    if not all(found[key] for key in ISOLATED):
        if os.geteuid() == 0:
            pytest.fail(f"running as root, yet the sandbox cannot isolate: {found}")
        pytest.skip("the sandbox's namespaces need root with CAP_SYS_ADMIN (the fallback: test_code_exec.py)")
    return found
