"""The base of every error a user can act on.

A :class:`UserError` means bad input (a config, a dataset, a checkpoint, a server's reply, a run directory), not
a bug: the command line prints its message and hint in a few lines, without a traceback (``--debug`` shows it),
and exits non-zero. Each package keeps its own subclass (``ConfigError``, ``DatasetError``, ``RolloutError``, ...)
so that callers can still catch the specific kind.
"""

from __future__ import annotations


class UserError(Exception):
    """An error caused by the user's input or environment; ``hint`` says what to do about it."""

    exit_code = 1
    hint: str | None = None

    def __init__(self, message: str = "", *args: object, hint: str | None = None) -> None:
        super().__init__(message, *args)
        if hint is not None:
            self.hint = hint

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigError(UserError, ValueError):
    """A configuration problem; the message names the field(s) and what to do."""

    exit_code = 2


class RunInterrupted(UserError):
    """The run stopped on a signal after writing a checkpoint; it can be resumed."""

    exit_code = 130
