"""Worker threads whose failures surface in the caller, and waits that never hang.

Note [Worker failures]: a worker that raises records the exception, fails every job still queued, and
stops. Every wait in the engine goes through :meth:`Workers.wait`, which polls in short slices and
re-raises the first worker failure (chained, with its original traceback) in the waiting thread, or
raises :class:`EngineTimeout` naming what it waited for once ``timeout_s`` has passed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["EngineError", "EngineTimeout", "Worker", "WorkerFailure", "Workers"]

T = TypeVar("T")

_POLL_S = 0.05


class EngineError(RuntimeError):
    """The engine cannot continue."""


class EngineTimeout(EngineError):
    """A wait took longer than the configured timeout."""


class WorkerFailure(EngineError):
    """A worker thread raised; the original exception is chained as ``__cause__``."""


_STOP = object()


class Worker:
    """One daemon thread draining a bounded queue of jobs in order."""

    def __init__(self, name: str, closing: threading.Event, max_queued: int = 1024) -> None:
        self.name = name
        self._closing = closing
        self._jobs: queue.Queue[Any] = queue.Queue(maxsize=max_queued)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"slide-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        if self.error is not None:
            future.set_exception(self._stopped_error())
            return future
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            future, fn, args = item
            if self._closing.is_set():
                future.set_exception(EngineError(f"the engine closed before this {self.name} job ran"))
                continue
            if self.error is not None:
                future.set_exception(self._stopped_error())
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                self.error = exc
                future.set_exception(exc)

    def _stopped_error(self) -> WorkerFailure:
        error = WorkerFailure(f"the {self.name} thread stopped after an earlier failure: {self.error!r}")
        error.__cause__ = self.error
        return error

    def stop(self, timeout_s: float) -> bool:
        """Ask the thread to finish its queue and exit; True when it did within ``timeout_s``."""
        if self._thread.is_alive():
            try:
                self._jobs.put(_STOP, timeout=timeout_s)
            except queue.Full:
                return False
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class Workers:
    """The engine's worker threads, and the one way to wait for anything they produce."""

    def __init__(self, names: tuple[str, ...], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._closing = threading.Event()
        self._workers = {name: Worker(name, self._closing) for name in names}

    def __getitem__(self, name: str) -> Worker:
        return self._workers[name]

    def check(self) -> None:
        """Raise the first recorded worker failure in the calling thread."""
        if self._closing.is_set():
            raise EngineError("the engine is closing; pending work was abandoned")
        for worker in self._workers.values():
            if worker.error is not None:
                raise WorkerFailure(f"the {worker.name} thread failed: {worker.error!r}") from worker.error

    def wait(self, future: Future[T], what: str) -> T:
        """Block until ``future`` is done, a worker fails, or the timeout passes (then raise)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return future.result(timeout=_POLL_S)
            except TimeoutError:
                pass
            self.check()
            if time.monotonic() > deadline:
                raise EngineTimeout(f"timed out after {self.timeout_s:.0f} s waiting for {what}")

    def get(self, source: queue.Queue[T], what: str) -> T:
        """``source.get()`` with the same failure and timeout rules as :meth:`wait`."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return source.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            self.check()
            if time.monotonic() > deadline:
                raise EngineTimeout(f"timed out after {self.timeout_s:.0f} s waiting for {what}")

    def stop(self, *, abandon: bool) -> list[str]:
        """Stop every worker; return the names of threads that did not exit in time.

        With ``abandon``, waits inside workers fail at once instead of finishing queued work.
        """
        if abandon:
            self._closing.set()
        return [name for name, worker in self._workers.items() if not worker.stop(self.timeout_s)]
