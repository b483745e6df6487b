"""Drive the one-machine Slurm cluster of ``tests/launch/slurm_cluster.sh`` from tests: submit the project's own
sbatch scripts, watch job states, wait for files. Plain ``sbatch`` / ``squeue`` / ``scontrol`` calls, no Slurm API.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "tests" / "launch" / "slurm_cluster.sh"
ROLLOUT_SCRIPT = REPO / "launch" / "slurm_rollout.sbatch"
TRAIN_SCRIPT = REPO / "launch" / "slurm_train.sbatch"
# States in which a job holds or waits for nodes; any other state is final for these tests.
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


class SlurmUnavailable(RuntimeError):
    """No usable Slurm here (not root, packages missing, a foreign slurm.conf, or the daemons did not start)."""


def start_cluster() -> None:
    """Bring the two-node loopback cluster up (idempotent); raise SlurmUnavailable with the reason otherwise."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("the test cluster needs root (it starts munged, slurmctld and slurmd)")
    for tool in ("slurmctld", "slurmd", "munged", "sbatch"):
        if not any((Path(d) / tool).exists() for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin")):
            raise SlurmUnavailable(f"{tool} is not installed (apt-get install slurm-wlm munge; see .ci/run)")
    done = subprocess.run(["bash", str(CLUSTER_SCRIPT), "up"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SlurmUnavailable(f"{CLUSTER_SCRIPT.name} up failed:\n{done.stdout}{done.stderr}")


@dataclass
class Job:
    """A submitted job: its id and the file its output goes to."""

    job_id: str
    output: Path

    def state(self) -> str:
        """Slurm's state of the job (RUNNING, PENDING, COMPLETED, FAILED, CANCELLED, ...)."""
        return job_field(self.job_id, "JobState")

    def output_text(self) -> str:
        return self.output.read_text() if self.output.exists() else "(no output file yet)"

    def wait_until(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """Poll ``predicate`` until it returns something truthy; fail with the job's output on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(
            f"job {self.job_id}: {what} not within {timeout} s\n{self.output_text()}\n{cluster_picture()}"
        )

    def wait_while_alive(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """Like :meth:`wait_until`, but fail at once (with the job's output) when the job ends first."""

        def check() -> Any:
            value = predicate()
            if not value and self.state() not in ("PENDING", "CONFIGURING", "RUNNING"):
                raise AssertionError(
                    f"job {self.job_id} ended ({self.state()}) before {what}\n{self.output_text()}"
                )
            return value

        return self.wait_until(check, timeout, what)

    def wait_final(self, timeout: float) -> str:
        """Wait until the job is no longer pending or running; returns its final state."""
        self.wait_until(lambda: self.state() not in ACTIVE_STATES, timeout, "end of the job")
        return self.state()

    def cancel(self) -> None:
        subprocess.run(["scancel", self.job_id], check=True, timeout=30)


def submit(
    script: Path, args: list[str], *, env: dict[str, str], workdir: Path, sbatch_options: list[str]
) -> Job:
    """``sbatch`` SCRIPT ARGS from ``workdir`` with ``env`` added to this environment; output in ``workdir``."""
    output = workdir / f"{script.stem}-%j.out"
    command = ["sbatch", "--parsable", f"--output={output}", *sbatch_options, str(script), *args]
    done = subprocess.run(
        command, cwd=workdir, env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise AssertionError(f"sbatch failed ({done.returncode}): {done.stderr}")
    job_id = done.stdout.strip().split(";")[0]
    return Job(job_id, workdir / f"{script.stem}-{job_id}.out")


def cluster_picture() -> str:
    """What Slurm says about the queue and the nodes (why a job is still pending), for failure messages."""
    lines = []
    for command in (["squeue", "-o", "%i %T %R %j"], ["sinfo", "-N", "-o", "%N %T %E"]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
            lines.append(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}")
        except (OSError, subprocess.TimeoutExpired) as error:
            lines.append(f"$ {' '.join(command)}: {error}")
    return "\n".join(lines)


def job_field(job_id: str, field: str) -> str:
    """One ``Key=Value`` field of ``scontrol show job`` (kept MinJobAge = 600 s after the job ends)."""
    done = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    )
    for item in done.stdout.split():
        key, _, value = item.partition("=")
        if key == field:
            return value
    raise AssertionError(f"scontrol show job {job_id}: no {field} in {done.stdout!r} {done.stderr!r}")


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive TCP ports on 127.0.0.1 that are free right now, below the kernel's
    ephemeral range (outgoing connections take ports from that range at any time, e.g. a router's metrics port)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        base = random.randrange(10000, min(20000, low) - count)  # tests/ports.py hands out 20000 and up
        if all(port_is_free(base + i) and port_can_bind(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no block of {count} free ports found between 10000 and {min(20000, low)}")


def port_can_bind(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def port_is_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port (a connection attempt is refused)."""
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex(("127.0.0.1", port)) != 0


def read_json_when_complete(path: Path) -> dict[str, Any] | None:
    """The JSON in ``path`` once it exists (the writers publish atomically), else None."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
