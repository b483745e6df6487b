"""Ports for the servers and rendezvous that tests start, chosen so that two tests cannot be handed the same one.

``bind(("127.0.0.1", 0))`` returns a port from the kernel's ephemeral range, free only at that instant: a server
that binds it seconds later (after its imports) can find it taken by another pytest-xdist worker's server, or by
any outgoing connection, which draws its local port from the same range. Here each port comes from below the
ephemeral range (so no outgoing connection or ``bind(0)`` is ever given it), from a slice of that span owned by
this xdist worker (so two workers never pick the same one), and is not handed out twice by one process.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from pathlib import Path

_SPAN = (20000, 32000)
"""Below Linux's default ephemeral range (32768-60999); narrowed further if this machine's range starts lower."""
_SLICES = 16
"""xdist workers gw0..gw15 each own one slice of the span (wrapping around past 16 workers)."""


def _span() -> tuple[int, int]:
    low, high = _SPAN
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return low, high
    return low, min(high, ephemeral_low)


def _slice() -> range:
    low, high = _span()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) % _SLICES if worker.isdigit() else 0
    width = (high - low) // _SLICES
    return range(low + index * width, low + (index + 1) * width)


def _candidates():
    ports = list(_slice())
    random.Random(os.getpid()).shuffle(ports)
    return itertools.cycle(ports)


_NEXT = _candidates()
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port on 127.0.0.1 that is free now, from this worker's slice, not handed out before by this process."""
    for _ in range(len(_slice())):
        port = next(_NEXT)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port left in {_slice()} for this test process")
