"""The console of ``sapo-megatron`` and the run's ``train.log``.

:func:`console` (entered by the CLI around a command) sets up, on the main rank:

- Python logging: warnings and errors on the console (stderr); into the run log, INFO and up of this package
  and warnings and errors of the libraries. Megatron-Core logs its whole DDP and optimizer config and every
  gradient bucket's parameter list at INFO: that stays out of ``train.log`` and the console unless
  ``--verbose`` (then both get every library's INFO too);
- a tee of ``sys.stdout`` / ``sys.stderr`` into the run log: what the console shows, as a terminal would
  show it (of a line redrawn with carriage returns, as progress bars are, only its final state), without
  colour codes;
- until the run's directory is known (:func:`attach_run_log`, called once :func:`run_dir.prepare_run_dir`
  accepted it), the run log is kept in memory (up to 1 MiB), so that a refused or failed start writes no file.

``train.log`` is appended across starts; each start begins with a header line. Other ranks log to the console
only. :func:`record_exception` puts a traceback into the run log alone, for errors the console shows as one line.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

MEMORY_LIMIT = 1 << 20
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
CPU_FALLBACK_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed\. Falling back",
)
"""Megatron-Core's import-time notices that it uses its pure-torch fallbacks: expected on a CPU machine."""
KNOWN_HARMLESS_WARNINGS = (
    # megatron-core 0.16.1's TransformerConfig turns its own default cuda_graph_scope "full" into [] with this
    # notice on every model build; the project never sets the field (transformer_config.py, __post_init__).
    ("full scope is deprecated", UserWarning, r"megatron\.core"),
    # Loading a distributed checkpoint (every --resume): torch's deprecation notices about the APIs Megatron-Core's
    # torch_dist strategy calls (dist_checkpointing/strategies/torch.py: checkpoint.load_state_dict, and the
    # ShardedTensor it builds, reached on CPU through megatron/cpu_compat.py's function mode).
    ("`load_state_dict` is deprecated", FutureWarning, r"megatron\.core\.dist_checkpointing"),
    (
        "Please use DTensor instead and we are deprecating ShardedTensor",
        FutureWarning,
        r"(megatron\.core|sapo_megatron\.megatron)",
    ),
)
"""(message, category, module) of library warnings that say nothing a user can act on; filtered by name."""
PACKAGE = "sapo_megatron"


class RunLog:
    """Where the run log goes: a memory buffer until :meth:`attach`, then ``train.log`` (appended)."""

    def __init__(self) -> None:
        self._buffer: list[str] = []
        self._buffered = 0
        self._file: IO[str] | None = None
        self.path: Path | None = None

    def write(self, text: str) -> None:
        if self._file is not None:
            self._file.write(text)
            self._file.flush()
        elif self._buffered < MEMORY_LIMIT:
            self._buffer.append(text)
            self._buffered += len(text)

    def attach(self, path: Path, header: str) -> None:
        """Start writing to ``path``: the header line, then what was buffered, then everything that follows."""
        if self._file is not None:
            self._file.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")
        self.path = path
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self._file.write(f"===== {stamp} {header} =====\n")
        self._file.writelines(self._buffer)
        self._file.flush()
        self._buffer, self._buffered = [], 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class _Tee:
    """A text stream that writes through to ``stream`` and copies finished lines, as displayed, to ``log``."""

    def __init__(self, stream: Any, log: RunLog) -> None:
        self._stream = stream
        self._log = log
        self._pending = ""

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        self._pending += text
        if "\n" in self._pending:
            *lines, self._pending = self._pending.split("\n")
            self._log.write("".join(displayed(line) + "\n" for line in lines))
        return written

    def flush(self) -> None:
        self._stream.flush()

    def finish(self) -> None:
        if self._pending.strip():
            self._log.write(displayed(self._pending) + "\n")
        self._pending = ""

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ... of the real stream
        return getattr(self._stream, name)


def displayed(line: str) -> str:
    """What a terminal ends up showing of ``line``: the text after its last carriage return, without colours."""
    return ANSI_ESCAPE.sub("", line.rsplit("\r", 1)[-1])


_active: RunLog | None = None


@contextlib.contextmanager
def console(*, is_main: bool = True, debug: bool = False, verbose: bool = False) -> Iterator[RunLog | None]:
    """Set up logging and the run log for one command (see the module docstring); undone on exit.

    Yields the :class:`RunLog` on the main rank, ``None`` elsewhere. ``debug`` shows this package's INFO
    messages on the console too; ``verbose`` shows every library's INFO on the console and in the run log.
    """
    global _active
    root = logging.getLogger()
    saved_level = root.level
    # The real stderr, not the tee below: the file handler writes records into the run log itself.
    stream_handler = logging.StreamHandler(sys.stderr)
    stream_handler.setLevel(logging.INFO if debug or verbose else logging.WARNING)
    if not verbose:
        stream_handler.addFilter(_quiet_libraries)
    stream_handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handlers: list[logging.Handler] = [stream_handler]
    run_log = RunLog() if is_main else None
    if run_log is not None:
        file_handler = logging.StreamHandler(run_log)
        file_handler.setLevel(logging.INFO)
        if not verbose:
            file_handler.addFilter(_quiet_libraries)
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(file_handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    saved_streams = sys.stdout, sys.stderr
    tees = [_Tee(stream, run_log) for stream in saved_streams] if run_log is not None else []
    if tees:
        sys.stdout, sys.stderr = tees
    _active = run_log
    try:
        yield run_log
    finally:
        for tee in tees:
            tee.finish()
        sys.stdout, sys.stderr = saved_streams
        for handler in handlers:
            root.removeHandler(handler)
        root.setLevel(saved_level)
        if run_log is not None:
            run_log.close()
        _active = None


def _quiet_libraries(record: logging.LogRecord) -> bool:
    """Keep this package's records and the libraries' warnings and errors (not their INFO)."""
    return record.levelno >= logging.WARNING or record.name.split(".")[0] in (PACKAGE, "__main__")


def attach_run_log(path: str | Path, header: str = "sapo-megatron") -> bool:
    """Send the run log (buffered so far, and from now on) to ``path`` (``<output_dir>/train.log``).

    Call on the main rank once the output directory is accepted. Returns ``False`` (and does nothing) outside
    :func:`console`, e.g. when the trainer is called from Python rather than the command line.
    """
    if _active is None:
        return False
    _active.attach(Path(path), header)
    return True


def record_exception(exc: BaseException) -> None:
    """Write the traceback of ``exc`` into the run log only (the console showed a one-line message)."""
    if _active is not None:
        _active.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def filter_known_warnings() -> None:
    """Hide the library warnings of :data:`KNOWN_HARMLESS_WARNINGS` (each by message, category and module)."""
    for message, category, module in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def filter_cpu_fallback_warnings() -> bool:
    """Hide Megatron-Core's "Transformer Engine / Apex not installed" notices on a machine without CUDA, where
    the fallbacks are the plan, not news. Returns whether it did (it does nothing where CUDA is available)."""
    import torch

    if torch.cuda.is_available():
        return False
    for pattern in CPU_FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    return True
