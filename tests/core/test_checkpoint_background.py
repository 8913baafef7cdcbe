"""slide_core/checkpoint/background.py: a checkpoint written on a thread from a snapshot (Note
[Background snapshot]) equals one written in the foreground, and its failures reach the caller."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
import torch

from slide_core.checkpoint import (
    BackgroundSaver,
    CheckpointWriteError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    writer,
)
from slide_core.checkpoint.background import snapshot


class _Source:
    """An ``ArraySource`` over a tensor that the "next step" keeps changing, like the engine's state."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data, self.numel, self.dtype = data, data.numel(), data.dtype

    def read_into(self, start: int, out: torch.Tensor) -> None:
        out.copy_(self.data[start : start + out.numel()])


class _ShardSource(_Source):
    whole_numel = 10
    intervals = ((2, 5), (7, 9))


def _arrays(seed: int) -> dict[str, torch.Tensor | _Source]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "master": torch.randn(3000, generator=generator),
        "exp_avg": _Source(torch.randn(3000, generator=generator)),
        "exp_avg_sq": _Source(torch.rand(3000, generator=generator).to(torch.bfloat16)),
    }


def _files(checkpoint: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(checkpoint.iterdir())}


def test_background_checkpoint_equals_foreground(tmp_path: Path) -> None:
    """The arrays change as soon as ``submit`` returns (the next step's updates); the checkpoint holds
    the state of the boundary all the same, byte for byte the foreground save's files."""
    extra = {"data": {"epoch": 0, "index": 7}}
    foreground = save_checkpoint(tmp_path / "fg", 4, _arrays(1), extra)
    live = _arrays(1)
    with BackgroundSaver() as saver:
        saver.submit(tmp_path / "bg", 4, live, extra)
        assert saver.pending_step == 4
        for array in live.values():  # the next optimizer step, in place
            (array if isinstance(array, torch.Tensor) else array.data).add_(1)
        background = saver.wait()
    assert background == tmp_path / "bg" / "step-00000004"
    assert _files(background) == _files(foreground)
    out = {
        "master": torch.empty(3000),
        "exp_avg": torch.empty(3000),
        "exp_avg_sq": torch.empty(3000, dtype=torch.bfloat16),
    }
    load_checkpoint(background, out)
    assert torch.equal(out["master"], _arrays(1)["master"])


def test_then_runs_in_the_callers_thread_when_the_save_is_collected(tmp_path: Path) -> None:
    seen: list[tuple[Path, str]] = []
    with BackgroundSaver() as saver:
        saver.submit(
            tmp_path, 1, _arrays(1), {}, then=lambda path: seen.append((path, threading.current_thread().name))
        )
        assert seen == []  # nothing runs until the save is collected
        saver.submit(tmp_path, 2, _arrays(2), {})  # one save at a time: collects step 1 first
        assert seen == [(tmp_path / "step-00000001", threading.current_thread().name)]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001", "step-00000002"]


@pytest.mark.timeout(60)
def test_a_failure_on_the_thread_is_raised_in_the_caller_and_leaves_no_checkpoint(tmp_path: Path, monkeypatch) -> None:
    save_checkpoint(tmp_path, 1, _arrays(1), {})

    def full(handle, data) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "_write", full)
    saver = BackgroundSaver()
    with saver:
        saver.submit(tmp_path, 2, _arrays(2), {})
        with pytest.raises(CheckpointWriteError, match=r"cannot write checkpoint .*step-00000002: No space left"):
            saver.wait()
        assert saver.pending_step is None and saver.poll() is None  # raised once, then nothing pending
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]  # no staging directory left


@pytest.mark.timeout(60)
def test_closing_raises_a_failure_nobody_collected(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(writer, "_write", lambda handle, data: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(CheckpointWriteError, match="I/O error"), BackgroundSaver() as saver:
        saver.submit(tmp_path, 1, _arrays(1), {})
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(60)
def test_a_failing_run_still_finishes_the_save_in_flight(tmp_path: Path) -> None:
    """The run's own error goes on; the checkpoint it submitted before failing is complete."""
    with pytest.raises(RuntimeError, match="the step failed"), BackgroundSaver() as saver:
        saver.submit(tmp_path, 3, _arrays(3), {})
        raise RuntimeError("the step failed")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003"]


def test_a_snapshot_is_a_copy_and_keeps_a_shards_place() -> None:
    source = _ShardSource(torch.arange(5, dtype=torch.float32))
    copies = snapshot({"master": source})
    source.data.zero_()
    copy = copies["master"]
    assert not isinstance(copy, torch.Tensor)
    assert copy.whole_numel == 10 and copy.intervals == ((2, 5), (7, 9))  # type: ignore[attr-defined]
    out = torch.empty(5)
    copy.read_into(0, out)
    assert torch.equal(out, torch.arange(5, dtype=torch.float32))


def test_a_saver_of_several_ranks_is_refused() -> None:
    class Group:
        rank, world_size = 0, 2

        def barrier(self, what: str, *, slow: bool = False) -> None: ...

    with pytest.raises(ValueError, match="one process"):
        BackgroundSaver(Group())


@pytest.mark.timeout(60)
def test_signals_while_waiting_neither_lose_the_save_nor_cut_the_wait_short(tmp_path: Path, monkeypatch) -> None:
    """A signal inside the wait for the save (KeyboardInterrupt) leaves it pending: closing still collects it
    and runs its ``then``. Closing goes on waiting through further signals, in the wait and in the join
    of the thread, so the staging directory is never left half-written behind a finished run; the first
    signal is raised once the thread is done."""
    from concurrent.futures import Future

    from slide_core.checkpoint import background

    release = threading.Event()
    fallback = threading.Timer(10, release.set)  # never hang the suite, whatever the code does
    fallback.start()
    real_save, real_result, real_join = background.save_checkpoint, Future.result, threading.Thread.join

    def slow_save(*args, **kwargs) -> Path:
        release.wait()
        return real_save(*args, **kwargs)

    signals = {"result": 2, "join": 1}

    def result(self, timeout=None):
        if signals["result"] and threading.current_thread() is threading.main_thread():
            signals["result"] -= 1
            if not signals["result"]:
                release.set()  # the write ends after the second signal
            raise KeyboardInterrupt
        return real_result(self, timeout)

    def join(self, timeout=None) -> None:
        if signals["join"] and self.name.startswith("slide-checkpoint"):
            signals["join"] -= 1
            raise KeyboardInterrupt
        real_join(self, timeout)

    monkeypatch.setattr(background, "save_checkpoint", slow_save)
    monkeypatch.setattr(Future, "result", result)
    monkeypatch.setattr(threading.Thread, "join", join)
    seen: list[Path] = []
    try:
        with pytest.raises(KeyboardInterrupt), BackgroundSaver() as saver:
            saver.submit(tmp_path, 1, _arrays(1), {}, then=seen.append)
            saver.wait()  # the run collects the save; a signal arrives
        writers = [t for t in threading.enumerate() if t.name.startswith("slide-checkpoint") and t.is_alive()]
    finally:
        release.set()
        fallback.cancel()
    assert writers == [] and signals == {"result": 0, "join": 0}
    assert seen == [tmp_path / "step-00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]  # no staging directory left


def test_the_second_save_copies_into_the_first_saves_buffers(tmp_path: Path) -> None:
    """Note [Snapshot buffers are kept]: the copies of a written save are reused by the next one (no new
    host memory, no first-touch page faults), and each checkpoint still holds its own step's values."""
    live = _arrays(1)
    with BackgroundSaver() as saver:
        assert saver.held_bytes == 0
        saver.submit(tmp_path, 1, live, {})
        first = dict(saver._buffers)
        held = saver.held_bytes
        assert held == 3000 * 4 + 3000 * 4 + 3000 * 2
        for array in live.values():
            (array if isinstance(array, torch.Tensor) else array.data).add_(1)
        expected_second = {name: (a if isinstance(a, torch.Tensor) else a.data).clone() for name, a in live.items()}
        saver.submit(tmp_path, 2, live, {})  # waits for step 1's write, then copies into its buffers
        assert all(saver._buffers[name] is first[name] for name in first)
        assert saver.held_bytes == held
        saver.wait()
    assert saver.held_bytes == 0  # closed: the memory is given back
    out = {
        "master": torch.empty(3000),
        "exp_avg": torch.empty(3000),
        "exp_avg_sq": torch.empty(3000, dtype=torch.bfloat16),
    }
    load_checkpoint(tmp_path / "step-00000001", out)
    assert torch.equal(out["master"], _arrays(1)["master"])
    load_checkpoint(tmp_path / "step-00000002", out)
    assert all(torch.equal(out[name], expected_second[name]) for name in out)


def test_a_buffer_of_another_size_is_not_reused() -> None:
    kept = {"master": torch.zeros(10), "exp_avg": torch.zeros(5)}
    copies = snapshot({"master": torch.ones(10), "exp_avg": torch.ones(6)}, reuse=kept)
    assert copies["master"] is kept["master"] and torch.equal(kept["master"], torch.ones(10))
    assert copies["exp_avg"] is not kept["exp_avg"] and torch.equal(kept["exp_avg"], torch.zeros(5))
