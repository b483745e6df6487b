"""Hostile-input tests: every attack runs against loopback servers in this process, bounded in count and time."""

from tests.rollout.conftest import moe_dir, one_torch_thread  # noqa: F401 (shared fixtures)
