"""tests/ports.py: the ports tests hand to servers and rendezvous never repeat within a process, stay below the
kernel's ephemeral range and inside this xdist worker's slice (two workers cannot be handed the same port)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.ports import _slice, free_port

REPO = Path(__file__).resolve().parents[1]


def test_ports_are_distinct_below_the_ephemeral_range_and_in_this_workers_slice():
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(port < ephemeral_low for port in ports)
    assert all(port in _slice() for port in ports)


def test_two_workers_draw_from_disjoint_slices():
    code = "from tests.ports import _slice; s = _slice(); print(s.start, s.stop)"
    spans = []
    for worker in ("gw0", "gw1"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTEST_XDIST_WORKER": worker, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
        ).stdout.split()
        spans.append(range(int(out[0]), int(out[1])))
    assert len(spans[0]) > 100 and len(spans[1]) > 100
    assert not set(spans[0]) & set(spans[1])
