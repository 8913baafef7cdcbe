"""How a message names an option: ``--save-best`` to a user of `slide train`, ``save_best=`` to a caller of
``slide_hf.train(...)``.

The same validation and run code serve both, and a message that tells a notebook user to pass
``--resume`` names something that does not exist there. So every message names an option through
:func:`option`, and the entry point says once which spelling its user reads: the Python API runs the
whole call inside :func:`keyword_spelling`. The choice is a :class:`~contextvars.ContextVar`, not a
module variable: it belongs to the call (two calls in two threads or tasks each keep their own), and
it is back to flags as soon as the call returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

__all__ = ["keyword_spelling", "option", "train_call"]

_KEYWORDS: ContextVar[bool] = ContextVar("slide_hf_keyword_spelling", default=False)


def option(name: str, value: Any = None) -> str:
    """``name`` (underscored, as a TrainConfig field) as this caller writes it: ``--keep-checkpoints`` or
    ``keep_checkpoints=``; with ``value``, the whole setting: ``--resume runs/a`` or ``resume='runs/a'``."""
    if _KEYWORDS.get():
        return f"{name}=" if value is None else f"{name}={str(value)!r}"
    flag = "--" + name.replace("_", "-")
    return flag if value is None else f"{flag} {value}"


def train_call(**settings: Any) -> str:
    """The call that runs training with ``settings``: ``slide train --resume runs/a`` or
    ``slide_hf.train(resume='runs/a')``."""
    if _KEYWORDS.get():
        return "slide_hf.train(" + ", ".join(option(name, value) for name, value in settings.items()) + ")"
    return " ".join(["slide train", *(option(name, value) for name, value in settings.items())])


@contextlib.contextmanager
def keyword_spelling() -> Iterator[None]:
    """Name options as keyword arguments (``resume=``) in every message raised inside the block."""
    token = _KEYWORDS.set(True)
    try:
        yield
    finally:
        _KEYWORDS.reset(token)
