"""Start ``python -m sapo_megatron.rollout.cpu_server`` as a real process and read the URL it prints."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVING_LINE = re.compile(r"^serving (?P<model>\S+) at (?P<url>http://127\.0\.0\.1:\d+)$")


def child_env() -> dict[str, str]:
    """The environment of a child Python that imports this checkout and uses one thread."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


class ServerProcess:
    """A CPU server process; ``url`` is read from its one stdout line, ``lines`` holds all it printed."""

    def __init__(self, *flags: str, startup_timeout_s: float = 120.0) -> None:
        command = [sys.executable, "-m", "sapo_megatron.rollout.cpu_server", *flags]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env()
        )
        self.lines: list[str] = []
        self._stdout: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        self._pumps = [
            threading.Thread(target=self._pump_stdout, daemon=True),
            threading.Thread(target=self._pump_stderr, daemon=True),
        ]
        for pump in self._pumps:
            pump.start()
        first = self._stdout.get(timeout=startup_timeout_s)
        if first is None:
            self.process.wait(timeout=30)
            raise RuntimeError(f"server exited ({self.process.returncode}): {self.stderr[-2000:]}")
        match = SERVING_LINE.match(first.rstrip("\n"))
        if match is None:
            raise RuntimeError(f"unexpected first line {first!r}")
        self.url = match["url"]

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def stop(self, signum: int | None = None, timeout_s: float = 30.0) -> int:
        """Send ``signum`` (SIGTERM by default), wait, return the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signum) if signum is not None else self.process.terminate()
        code = self.process.wait(timeout=timeout_s)
        for pump in self._pumps:
            pump.join(timeout=timeout_s)
        return code

    def _pump_stdout(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            self._stdout.put(line)
        self._stdout.put(None)

    def _pump_stderr(self) -> None:
        for line in self.process.stderr:
            self._stderr.append(line)
