"""slide_core/engine/workers.py on its own: job order, failures that surface in the caller (Note [Worker
failures]), waits that time out naming what they waited for, and stopping with or without the queue."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import pytest

from slide_core.engine.workers import EngineError, EngineTimeout, Worker, WorkerFailure, Workers


@pytest.fixture
def workers():
    pool = Workers(("a", "b"), timeout_s=5.0)
    yield pool
    assert pool.stop(abandon=True) == []


def _blocked(worker: Worker) -> threading.Event:
    """Hold ``worker`` busy until the returned event is set, so jobs queue up behind it."""
    release = threading.Event()
    started = threading.Event()

    def hold() -> None:
        started.set()
        release.wait(5.0)

    worker.submit(hold)
    assert started.wait(5.0)
    return release


def test_jobs_run_by_priority_then_in_submission_order(workers: Workers) -> None:
    ran: list[str] = []
    release = _blocked(workers["a"])
    futures = [
        workers["a"].submit(ran.append, "late", priority=(2,)),
        workers["a"].submit(ran.append, "first", priority=(1, 0)),
        workers["a"].submit(ran.append, "second", priority=(1, 0)),
        workers["a"].submit(ran.append, "third", priority=(1, 5)),
    ]
    release.set()
    for future in futures:
        workers.wait(future, "a job")
    assert ran == ["first", "second", "third", "late"]


def test_a_result_comes_back_through_wait(workers: Workers) -> None:
    assert workers.wait(workers["b"].submit(lambda x, y: x * y, 6, 7), "a product") == 42


def test_a_failing_job_fails_its_future_the_queue_and_later_waits(workers: Workers) -> None:
    release = _blocked(workers["a"])
    boom = ValueError("disk on fire")

    def fail() -> None:
        raise boom

    failing = workers["a"].submit(fail)
    queued = workers["a"].submit(lambda: "never")
    release.set()
    with pytest.raises(ValueError, match="disk on fire"):
        workers.wait(failing, "the failing job")
    with pytest.raises(WorkerFailure, match="the a thread stopped after an earlier failure") as stopped:
        workers.wait(queued, "a queued job")
    assert stopped.value.__cause__ is boom
    late = workers["a"].submit(lambda: "too late")  # submitted after the failure: failed at once
    assert late.done() and isinstance(late.exception(), WorkerFailure)
    # A wait on anything else (here, another worker's future that never completes) raises the failure too.
    with pytest.raises(WorkerFailure, match="the a thread failed: ValueError") as raised:
        workers.wait(Future(), "something else")
    assert raised.value.__cause__ is boom


def test_a_wait_that_never_ends_times_out_naming_what_it_waited_for() -> None:
    pool = Workers(("a",), timeout_s=0.2)
    try:
        with pytest.raises(EngineTimeout, match=r"timed out after 0 s waiting for the parameters of block\.3"):
            pool.wait(Future(), "the parameters of block.3")
        with pytest.raises(EngineTimeout, match="waiting for a gradient chunk"):
            pool.get(queue.Queue(), "a gradient chunk")
    finally:
        assert pool.stop(abandon=True) == []


def test_get_returns_items_and_surfaces_failures(workers: Workers) -> None:
    source: queue.Queue[int] = queue.Queue()
    source.put(3)
    assert workers.get(source, "an item") == 3
    workers["b"].submit(lambda: 1 / 0)
    with pytest.raises(WorkerFailure, match="the b thread failed: ZeroDivisionError"):
        workers.get(source, "an item that will not come")


def test_stop_finishes_the_queue_unless_abandoned() -> None:
    pool = Workers(("a",), timeout_s=5.0)
    ran: list[int] = []
    release = _blocked(pool["a"])
    futures = [pool["a"].submit(ran.append, i) for i in range(3)]
    release.set()
    assert pool.stop(abandon=False) == []
    assert ran == [0, 1, 2] and all(f.done() and f.exception() is None for f in futures)
    assert not pool["a"].alive

    pool = Workers(("a",), timeout_s=5.0)
    release = _blocked(pool["a"])
    abandoned = pool["a"].submit(ran.append, 99)
    threading.Timer(0.2, release.set).start()  # the busy job ends only after stop() has begun abandoning
    assert pool.stop(abandon=True) == []
    assert not pool["a"].alive
    with pytest.raises(EngineError, match="the engine closed before this a job ran"):
        abandoned.result(timeout=1.0)
    assert 99 not in ran
    with pytest.raises(EngineError, match="the engine is closing"):
        pool.check()
