"""The CPU server as a real process for tests (see :mod:`sapo_megatron.rollout.cpu.process`), with an
environment that imports this checkout."""

from __future__ import annotations

import os
from pathlib import Path

from sapo_megatron.rollout.cpu import process as server_process

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVING_LINE = server_process.SERVING_LINE


def child_env() -> dict[str, str]:
    """The environment of a child Python that imports this checkout and uses one thread."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


class ServerProcess(server_process.ServerProcess):
    def __init__(self, *flags: str, startup_timeout_s: float = 120.0) -> None:
        super().__init__(*flags, startup_timeout_s=startup_timeout_s, env=child_env())
