"""Saying a data note once per command, however many encoders meet its cause.

`slide data` previews records and then prepares them, and `slide train --eval-data` prepares two sources:
each builds its own :class:`~slide_hf.data.chat.ChatEncoder`, and each would say that the template
re-renders earlier turns, or folds system messages. A note logged with ``extra={"once": key}`` passes
:func:`each_note_once`'s filter the first time its key is seen inside the block, and is dropped after.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Hashable, Iterator

__all__ = ["each_note_once"]


class _Once(logging.Filter):
    """Drops a record whose ``once`` key an earlier record already carried."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[Hashable] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = getattr(record, "once", None)
        if key is None:
            return True
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


@contextlib.contextmanager
def each_note_once(name: str = "slide.data") -> Iterator[None]:
    """Inside the block, each keyed note of logger ``name`` is logged once."""
    logger = logging.getLogger(name)
    once = _Once()
    logger.addFilter(once)
    try:
        yield
    finally:
        logger.removeFilter(once)
