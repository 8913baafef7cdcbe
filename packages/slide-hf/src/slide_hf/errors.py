"""Errors a user can fix: the CLI prints them as one line, with no traceback."""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(ValueError):
    """Bad input: a path, an option, a data line, a model that cannot fit. The message names it."""
