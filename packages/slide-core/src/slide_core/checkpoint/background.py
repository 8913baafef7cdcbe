"""Checkpoints written on a thread while training goes on, from a snapshot taken between two steps.

Note [Background snapshot]: the saved state must be that of one step boundary, but the next step updates
the master and optimizer state in place (host slabs, GPU, a state tier). So :meth:`BackgroundSaver.submit`
first copies every array, in the caller's thread and before it returns, into host tensors of its own
(one checkpoint's bytes of pageable host memory, freed when the write ends); the thread then writes
those copies and nothing else. The caller submits between steps, after the engine has finished every
update (``Engine.checkpoint_arrays`` waits for them), so the copy is the state of that boundary, and the
files are byte for byte those a save in the foreground of the same step writes
(``test_background_checkpoint_equals_foreground``).

Note [Snapshot buffers are kept]: the copy is the only part of a background save that holds training up,
and into freshly allocated pageable memory it runs at the speed of the kernel's first-touch page faults,
not of memory: 2 GiB took 0.4-3.2 s that way on a 2-core development machine, against 0.1 s into pages
already touched. So the saver keeps the copies of its previous save once that save is written, and the
next :meth:`BackgroundSaver.submit` copies into them wherever an array keeps its size and dtype (every
array, in a run whose layout does not change): from the second save on the copy runs at memory speed.
The price is that one checkpoint's bytes of host memory stay held from the first background save to the
end of the run, rather than only while a save is written; ``slide plan --save-async`` counts them in the
host peak (slide_hf/planner/save_cost.py), and :attr:`BackgroundSaver.held_bytes` tells a run that checks
the host before a save what it already holds. Tested by
``test_the_second_save_copies_into_the_first_saves_buffers``.

The write itself is :func:`~.writer.save_checkpoint`, atomic as ever: a failure on the thread leaves no
published checkpoint, only a staging directory it removes, and is raised in the caller's thread by the
next :meth:`~BackgroundSaver.poll`, :meth:`~BackgroundSaver.wait` or :meth:`~BackgroundSaver.submit`, or
by closing the saver. One save is in flight at a time: a new one waits for the previous.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from . import manifest
from .arrays import ArraySource, Interval, placement
from .writer import CheckpointGroup, save_checkpoint

__all__ = ["BackgroundSaver", "snapshot"]

log = logging.getLogger("slide.checkpoint")


class _ShardCopy:
    """A copied :class:`~.arrays.Shard` source: its elements in a host tensor, its place in the whole
    array kept (the checkpoint records it)."""

    def __init__(self, data: torch.Tensor, whole_numel: int, intervals: tuple[Interval, ...]) -> None:
        self.data = data
        self.numel = data.numel()
        self.dtype = data.dtype
        self.whole_numel = whole_numel
        self.intervals = intervals

    def read_into(self, start: int, out: torch.Tensor) -> None:
        out.copy_(self.data[start : start + out.numel()])


def snapshot(
    arrays: Mapping[str, torch.Tensor | ArraySource], reuse: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor | ArraySource]:
    """A copy of every array in host memory of its own (Note [Background snapshot]): a tensor copied, a
    source read block by block; into ``reuse``'s tensor of the same name where it has the array's size
    and dtype (Note [Snapshot buffers are kept]), else into a new one. A shard of part of its array keeps
    its place in the whole array (one process's "shard" of every unit is the whole array, copied as a
    plain tensor)."""
    reuse = reuse or {}
    copies: dict[str, torch.Tensor | ArraySource] = {}
    for name, array in arrays.items():
        shape = tuple(array.shape) if isinstance(array, torch.Tensor) else (array.numel,)
        kept = reuse.get(name)
        if kept is not None and tuple(kept.shape) == shape and kept.dtype == array.dtype:
            data = kept
        else:
            data = torch.empty(shape, dtype=array.dtype)
        if isinstance(array, torch.Tensor):
            data.copy_(array.detach())
        else:
            per_block = max(1, manifest.BLOCK_BYTES // array.dtype.itemsize)
            for start in range(0, array.numel, per_block):
                array.read_into(start, data[start : start + per_block])
        whole, intervals = placement(array)
        if intervals == ((0, whole),) or whole == 0:  # the whole array: written as a tensor, the fast path
            copies[name] = data
        else:
            copies[name] = _ShardCopy(data, whole, intervals)
    return copies


@dataclass
class _Pending:
    step: int
    future: Future[Path]
    then: Callable[[Path], None]


def _buffers(copies: Mapping[str, torch.Tensor | ArraySource]) -> dict[str, torch.Tensor]:
    """The host tensors a snapshot's copies are held in, by array name."""
    buffers: dict[str, torch.Tensor] = {}
    for name, copy in copies.items():
        data = copy.data if isinstance(copy, _ShardCopy) else copy
        assert isinstance(data, torch.Tensor), "a snapshot copies every array into a host tensor"
        buffers[name] = data
    return buffers


class BackgroundSaver:
    """Writes one checkpoint at a time on its own thread (Note [Background snapshot]). A context
    manager: the thread starts in ``__enter__``; ``__exit__`` (or :meth:`close`, safe to call twice)
    waits for the save in flight, so a run that ends or fails still leaves it complete or absent.

    ``group``: the ranks that save together. Only a world of one may save in the background: a save of
    several ranks meets at barriers, and collectives must not run on a thread beside the training's."""

    def __init__(self, group: CheckpointGroup | None = None) -> None:
        if group is not None and group.world_size != 1:
            raise ValueError("a background checkpoint is written by one process; this group has several")
        self._group = group
        self._pool: ThreadPoolExecutor | None = None
        self._pending: _Pending | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        """The copies of the latest save, kept for the next one (Note [Snapshot buffers are kept])."""

    def __enter__(self) -> BackgroundSaver:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slide-checkpoint")
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if error is None:
            self.close()
            return
        try:  # the run failed: still finish the save in flight, and let the run's own error through
            self.close()
        except KeyboardInterrupt:
            raise  # a signal while closing: re-raised by close once the save in flight is written
        except Exception as failure:
            log.error("the checkpoint written in the background failed too: %s", failure)

    @property
    def held_bytes(self) -> int:
        """Host bytes the saver holds for its copies (Note [Snapshot buffers are kept]): what a save of
        the same arrays needs beyond it is the difference."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    @property
    def pending_step(self) -> int | None:
        """The step whose save is in flight, or ``None``."""
        return None if self._pending is None else self._pending.step

    def submit(
        self,
        root: Path,
        step: int,
        arrays: Mapping[str, torch.Tensor | ArraySource],
        extra: Mapping[str, Any],
        then: Callable[[Path], None] = lambda path: None,
    ) -> None:
        """Wait for the save in flight (raising its error), copy ``arrays`` (they may change as soon as
        this returns) and write them as checkpoint ``root/step-NNNNNNNN`` on the thread. ``then`` runs in
        the caller's thread, with the published path, when a later call collects the save."""
        if self._pool is None:
            raise RuntimeError("BackgroundSaver.submit needs an open saver (use it as a context manager)")
        self.wait()
        copies = snapshot(arrays, reuse=self._buffers)  # the previous save is written: its copies are free
        self._buffers = _buffers(copies)
        future = self._pool.submit(save_checkpoint, root, step, copies, dict(extra), self._group)
        self._pending = _Pending(step, future, then)

    def poll(self) -> Path | None:
        """Collect the save in flight if it has finished, without waiting: its path (after its ``then``
        ran), or ``None`` when none finished. Raises the save's error."""
        if self._pending is None or not self._pending.future.done():
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Wait for the save in flight and collect it (note: blocks until the write is on disk); its path,
        or ``None`` when none was in flight. Raises the save's error."""
        pending = self._pending
        if pending is None:
            return None
        # A signal raised while waiting (KeyboardInterrupt) leaves the save pending: the next wait, or
        # closing, still collects it and runs its ``then``. The save's own error collects it.
        try:
            path = pending.future.result()
        except Exception:
            self._pending = None
            raise
        self._pending = None
        pending.then(path)
        return path

    def close(self) -> None:
        """Wait for the save in flight (its ``then`` runs) and stop the thread; raises the save's error.
        A signal does not cut the wait short: the thread writes a staging directory of the run, which must
        be finished or removed before the run lets go of its directory, so each signal is logged and the
        wait goes on; the first is raised once the thread is done."""
        interrupted: KeyboardInterrupt | None = None
        try:
            while True:
                try:
                    self.wait()
                    break
                except KeyboardInterrupt as signal:
                    interrupted = interrupted or signal
                    log.warning("a checkpoint is still being written; waiting")
        finally:
            while self._pool is not None:
                try:
                    self._pool.shutdown(wait=True)
                    self._pool = None
                except KeyboardInterrupt as signal:
                    interrupted = interrupted or signal
                    log.warning("a checkpoint is still being written; waiting")
        self._buffers = {}  # nothing more is saved: give the copies' memory back
        if interrupted is not None:
            raise interrupted
