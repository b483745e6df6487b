"""Start the CPU rollout server (``python -m sapo_megatron.rollout.cpu.server``) as a real process and read the URL
it prints: for tests, benchmarks and tools that need a server in another process, like an SGLang worker."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading

SERVING_LINE = re.compile(r"^serving (?P<model>\S+) at (?P<url>http://[^\s:]+:\d+)$")


class ServerProcess:
    """A CPU server process (``sapo-megatron serve`` flags, e.g. ``--model-path DIR --port 0``); ``url`` is read
    from the one line it prints when listening, so port 0 (any free port) needs no guessing; ``lines`` holds all
    it printed."""

    def __init__(
        self, *flags: str, startup_timeout_s: float = 120.0, env: dict[str, str] | None = None
    ) -> None:
        command = [sys.executable, "-m", "sapo_megatron.rollout.cpu.server", *flags]
        env = env if env is not None else {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
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
        assert self.process.stdout is not None  # started with stdout=PIPE
        for line in self.process.stdout:
            self.lines.append(line)
            self._stdout.put(line)
        self._stdout.put(None)

    def _pump_stderr(self) -> None:
        assert self.process.stderr is not None  # started with stderr=PIPE
        for line in self.process.stderr:
            self._stderr.append(line)
