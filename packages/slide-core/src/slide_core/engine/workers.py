"""Worker threads whose failures surface in the caller, and waits that never hang.

Note [Worker failures]: a worker that raises records the exception, fails every job still queued, and
stops. Every wait in the engine goes through :meth:`Workers.wait`, which polls in short slices and
re-raises the first worker failure (chained, with its original traceback) in the waiting thread, or
raises :class:`EngineTimeout` naming what it waited for once ``timeout_s`` has passed.
"""

from __future__ import annotations

import itertools
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
    """One daemon thread draining a queue of jobs: in submission order, or by ``priority`` when given.

    Note [Optimizer priority]: the optimizer thread takes the landed gradient chunk whose unit the next
    forward needs first (lowest forward position), not the oldest. Backward delivers gradients last unit
    first, so in FIFO order the first blocks (needed first by the next forward) are updated last and
    the next forward waits for the whole backlog, while the CPU then idles during that forward. With the
    priority order the backlog left at the end of backward is the *last* blocks, which the CPU updates
    while the GPU runs the next forward. Jobs whose order matters share a priority prefix (the step,
    the unit, the contribution), so reordering only ever happens between independent jobs. Tested by
    ``test_engine_matches_plain_adamw`` and ``test_gradient_accumulation_matches`` (every config runs
    with this order).
    """

    def __init__(self, name: str, closing: threading.Event) -> None:
        self.name = name
        self._closing = closing
        self._jobs: queue.PriorityQueue[Any] = queue.PriorityQueue()
        self._sequence = itertools.count()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"slide-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any, priority: tuple[Any, ...] = ()) -> Future[T]:
        """Queue ``fn(*args)``; lower ``priority`` tuples run first, equal ones in submission order."""
        future: Future[T] = Future()
        if self.error is not None:
            future.set_exception(self._stopped_error())
            return future
        self._jobs.put(((0, *priority), next(self._sequence), (future, fn, args)))
        return future

    def _run(self) -> None:
        while True:
            _, _, item = self._jobs.get()
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
            self._jobs.put(((1,), next(self._sequence), _STOP))  # after every queued job
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
