"""Length-prefixed pickle frames between the trainer and its reward workers (stdlib only)."""

from __future__ import annotations

import os
import pickle
import struct
from typing import IO, Any

HEADER = struct.Struct(">Q")


def write_frame(stream: IO[bytes], message: Any) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_exact(fd: int, size: int) -> bytes | None:
    """``size`` bytes from ``fd``, or None at end of file."""
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> Any | None:
    header = read_exact(fd, HEADER.size)
    if header is None:
        return None
    payload = read_exact(fd, HEADER.unpack(header)[0])
    return None if payload is None else pickle.loads(payload)
