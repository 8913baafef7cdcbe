"""Errors a user can fix, and a run's orderly stop: the CLI prints them as one line, with no traceback."""

from __future__ import annotations

import sys

__all__ = ["Interrupted", "RunStopped", "UnknownOption", "UserError", "say"]


class UserError(ValueError):
    """Bad input: a path, an option, a data line, a model that cannot fit. The message names it."""


class UnknownOption(UserError, TypeError):
    """An option name that does not exist (a TOML key, a keyword of ``slide_hf.train``): the message names
    it and the option meant. A ``TypeError`` too, as Python's own unexpected keyword argument is."""


class RunStopped(Exception):
    """A run stopped because it was asked to (SIGINT, SIGTERM) after saving what it needs to continue.

    Not an error: the message says how to continue, and the CLI exits with ``exit_code`` (128 + the
    signal number, as a shell reports a process the signal ended: 130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Interrupted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM, which ends a run at once instead of after its checkpoint. A
    ``KeyboardInterrupt``, so cleanup written for Ctrl-C runs; ``exit_code`` is 128 + the number of the
    signal that forced the exit (130 for SIGINT, 143 for SIGTERM), as a shell reports a process it ended."""

    def __init__(self, signal_name: str, exit_code: int) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.exit_code = exit_code


def say(line: str) -> None:
    """Print ``line`` to stderr in one write, so the lines of several processes never mix.

    ``print(line, file=sys.stderr)`` writes the text and its newline separately, which on a buffered stderr
    still leaves as one write; under ``PYTHONUNBUFFERED`` (common in containers and job scripts) stderr writes
    through, each part is a write of its own, and the ranks of a data-parallel run, which share one stderr
    and fail together, interleave: one rank's error line ends up inside another's. A single write of up to
    ``PIPE_BUF`` bytes (4096 on Linux) to a pipe is never split."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
