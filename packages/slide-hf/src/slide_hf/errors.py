"""Errors a user can fix, and a run's orderly stop: the CLI prints them as one line, with no traceback."""

from __future__ import annotations

__all__ = ["RunStopped", "UserError"]


class UserError(ValueError):
    """Bad input: a path, an option, a data line, a model that cannot fit. The message names it."""


class RunStopped(Exception):
    """A run stopped because it was asked to (SIGINT, SIGTERM) after saving what it needs to continue.

    Not an error: the message says how to continue, and the CLI exits with ``exit_code`` (128 + the
    signal number, as a shell reports a process the signal ended: 130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
