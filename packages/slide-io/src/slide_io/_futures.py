"""Small future helpers: an already-finished future, and one future for a request split into parts.

The NVMe tiers split a large tensor into parts that run on several I/O threads at once. The caller gets a
single future that finishes when every part has, and a ``finish`` step (installing the key in the index)
runs exactly once, only when all parts succeeded, so a failed write never replaces a good key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any, TypeVar

__all__ = ["done", "failed", "gather"]

T = TypeVar("T")


def done(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future


def failed(error: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(error)
    return future


def _error_of(part: Future[Any]) -> BaseException | None:
    return CancelledError() if part.cancelled() else part.exception()


def gather(
    parts: Sequence[Future[Any]],
    finish: Callable[[], T],
    fail: Callable[[BaseException], BaseException],
) -> Future[T]:
    """One future for ``parts``.

    When every part succeeded, its result is ``finish()``. Otherwise ``fail(first_error)`` runs once (to
    clean up and to translate the error) and its return value becomes the future's exception. Both run in
    the thread that completes the last part.
    """
    outer: Future[T] = Future()
    remaining = [len(parts)]
    lock = threading.Lock()

    def settle() -> None:
        errors = [error for part in parts if (error := _error_of(part)) is not None]
        try:
            if errors:
                outer.set_exception(fail(errors[0]))
            else:
                outer.set_result(finish())
        except BaseException as error:  # a failing finish/fail must still settle the future
            if not outer.done():
                outer.set_exception(error)

    def on_part_done(_: Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            settle()

    if not parts:
        settle()
    for part in parts:
        part.add_done_callback(on_part_done)
    return outer
