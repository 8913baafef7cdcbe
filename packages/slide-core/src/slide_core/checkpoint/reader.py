"""Loading a checkpoint: the one reader, which verifies every block it reads, for every format and every
world size.

A load asks, for each array, for the ranges of the whole array its target holds (a host tensor: all of
it; an engine rank's sink: its shard of every unit, :class:`~.arrays.Shard`) and reads each range from
whichever shard file holds it, in the target's own element order. So one process reads a checkpoint of N
ranks, and each of M ranks reads its shards out of a checkpoint of N (resharding).

Note [Verified before handed over]: the first time any byte of a 256 MiB block of a file part is read,
the whole block is read and its CRC32 compared with the manifest's before any of it reaches the target; a
later range inside an already verified block reads its own bytes only. So a rank reads and checks only
the blocks that hold its shards, through one block-sized buffer (a host tensor target is read into
directly where a range covers a whole block).
"""

from __future__ import annotations

import bisect
import io
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from . import manifest
from .arrays import ArraySink, Interval, as_bytes, placement
from .errors import CheckpointCorrupt
from .legacy import legacy_intervals, legacy_manifest
from .manifest import Manifest, Part, current_manifest, read_state

__all__ = ["load_checkpoint", "verify_checkpoint"]


def open_manifest(path: Path) -> Manifest:
    """Checkpoint ``path``'s :class:`Manifest`, whatever its format. Raises :class:`CheckpointCorrupt`."""
    state = read_state(path)
    if state["format"] < manifest.FORMAT:
        return legacy_manifest(path, state)
    return current_manifest(path, state)


Deliver = Callable[[int, torch.Tensor], None]
"""Takes ``(element offset from the range's start, the verified bytes)``."""


class _PartReader:
    """Element ranges of a checkpoint's file parts, verified block by block (Note [Verified before handed
    over]), through one buffer. Each file's size is checked when it is first opened."""

    def __init__(self, found: Manifest) -> None:
        self.manifest = found
        largest = max((nbytes for nbytes in found.file_bytes.values()), default=0)
        self.buffer = torch.empty(min(manifest.BLOCK_BYTES, largest), dtype=torch.uint8)
        self.view = self.buffer.numpy().data
        self.verified: set[tuple[Path, int, int]] = set()
        self.handles: dict[Path, io.BufferedReader] = {}

    def __enter__(self) -> _PartReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for handle in self.handles.values():
            handle.close()
        self.handles.clear()

    def _handle(self, file: Path) -> io.BufferedReader:
        handle = self.handles.get(file)
        if handle is not None:
            return handle
        expected, name = self.manifest.file_bytes[file], self.manifest.name_of(file)
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise self.manifest.corrupt(f"{name} is missing") from None
        if size != expected:
            raise self.manifest.corrupt(f"{name} is {size} bytes, expected {expected}: truncated?")
        handle = self.handles[file] = file.open("rb")
        return handle

    def read(
        self, part: Part, array: str, itemsize: int, first: int, count: int, into: memoryview | None, deliver: Deliver
    ) -> None:
        """Elements ``[first, first + count)`` of ``part`` (of ``array``), into the bytes ``into`` when
        given, else handed to ``deliver`` piece by piece."""
        handle = self._handle(part.file)
        size = manifest.BLOCK_BYTES
        part_end = part.offset + part.numel * itemsize
        start = part.offset + first * itemsize
        end = start + count * itemsize
        cursor = start
        while cursor < end:
            block = (cursor - part.offset) // size
            block_start = part.offset + block * size
            block_end = min(part_end, block_start + size)
            stop = min(end, block_end)
            key = (part.file, part.offset, block)
            if key in self.verified:
                handle.seek(cursor)
                if into is not None:
                    handle.readinto(into[cursor - start : stop - start])
                else:
                    handle.readinto(self.view[: stop - cursor])
                    deliver((cursor - start) // itemsize, self.buffer[: stop - cursor])
            elif into is not None and cursor == block_start and stop == block_end:
                self._check(handle, part, array, block, into[cursor - start : stop - start])
            else:
                self._check(handle, part, array, block, self.view[: block_end - block_start])
                data = self.buffer[cursor - block_start : stop - block_start]
                if into is not None:
                    into[cursor - start : stop - start] = as_bytes(data)
                else:
                    deliver((cursor - start) // itemsize, data)
            cursor = stop

    def _check(self, handle: io.BufferedReader, part: Part, array: str, block: int, out: memoryview) -> None:
        """Read ``part``'s block ``block`` whole into ``out`` and compare its CRC32 with the manifest's."""
        block_start = part.offset + block * manifest.BLOCK_BYTES
        handle.seek(block_start)
        got = handle.readinto(out)
        if got != len(out) or zlib.crc32(out) != part.crc32[block]:
            name = self.manifest.name_of(part.file)
            raise self.manifest.corrupt(
                f"{name} fails its checksum in block {block} of {array} (bytes {block_start}+ of the file)"
            )
        self.verified.add((part.file, part.offset, block))

    def verify(self, part: Part, array: str, itemsize: int) -> None:
        """Read and check every block of ``part``."""
        handle = self._handle(part.file)
        nbytes = part.numel * itemsize
        for block in range(len(part.crc32)):
            length = min(manifest.BLOCK_BYTES, nbytes - block * manifest.BLOCK_BYTES)
            self._check(handle, part, array, block, self.view[:length])


def verify_checkpoint(path: Path) -> None:
    """Check all of checkpoint ``path`` without loading it anywhere: its state, every file's size and
    every block's CRC32, read through one bounded buffer. Raises :class:`CheckpointCorrupt`."""
    found = open_manifest(path)
    with _PartReader(found) as reader:
        for name, parts in found.parts.items():
            for part in parts:
                reader.verify(part, name, found.arrays[name].dtype.itemsize)


@dataclass(frozen=True)
class _Piece:
    """Elements ``[start, stop)`` of the whole array, in ``part`` from its element ``first`` on."""

    start: int
    stop: int
    part: Part
    first: int


def load_checkpoint(
    path: Path,
    arrays: Mapping[str, torch.Tensor | ArraySink],
    *,
    unit_numels: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Verify ``path`` and read it into ``arrays`` (name -> flat host tensor or :class:`ArraySink`, whole
    or a :class:`~.arrays.Shard` of its array); return its verified state (``step``, ``world_size``, the
    saver's ``extra``). Any world size reads a checkpoint of any other.

    ``unit_numels`` (the units' element counts, in slab order) is needed only to read a data-parallel
    checkpoint of format 2, which did not record where each rank's shards lie.

    Raises :class:`CheckpointCorrupt` naming the first bad thing: a missing or truncated file, a block
    that fails its checksum, an array of another size or dtype (another model), elements the checkpoint
    does not hold."""
    found = open_manifest(path)
    with _PartReader(found) as reader:
        for name, target in arrays.items():
            pieces = _pieces(found, name, target, unit_numels)
            _read_array(found, reader, name, target, pieces)
    return found.state


def _pieces(
    found: Manifest, name: str, target: torch.Tensor | ArraySink, unit_numels: Sequence[int] | None
) -> list[_Piece]:
    """Where ``name``'s elements are, sorted; checked against what ``target`` is."""
    info = found.arrays.get(name)
    if info is None:
        raise found.corrupt(f"state.json lists no array {name}")
    whole, _ = placement(target)
    dtype = str(target.dtype).removeprefix("torch.")
    saved = str(info.dtype).removeprefix("torch.")
    if info.numel is not None and (info.numel != whole or info.dtype != target.dtype):
        raise CheckpointCorrupt(
            f"checkpoint {found.path}: its {name} holds {info.numel} x {saved}; this run needs {whole} x {dtype} "
            "(a different model?)"
        )
    pieces = []
    for part in found.parts[name]:
        intervals = part.intervals
        if intervals is None:
            intervals = _legacy_intervals(found, name, part, target, whole, unit_numels)
        first = 0
        for start, stop in intervals:
            pieces.append(_Piece(start, stop, part, first))
            first += stop - start
    return sorted(pieces, key=lambda piece: piece.start)


def _legacy_intervals(
    found: Manifest,
    name: str,
    part: Part,
    target: torch.Tensor | ArraySink,
    whole: int,
    unit_numels: Sequence[int] | None,
) -> tuple[Interval, ...]:
    assert part.legacy_rank is not None
    if unit_numels is None or sum(unit_numels) != whole:
        raise ValueError(f"reading the data-parallel checkpoint {found.path} needs the units' element counts")
    rank, world_size = part.legacy_rank
    intervals = legacy_intervals(unit_numels, rank, world_size)
    want = sum(stop - start for start, stop in intervals)
    if part.numel != want or found.arrays[name].dtype != target.dtype:
        dtype, saved = str(target.dtype).removeprefix("torch."), str(found.arrays[name].dtype).removeprefix("torch.")
        whose = f"rank {rank} of {world_size}" if world_size > 1 else "one process"
        raise CheckpointCorrupt(
            f"{found.name_of(part.file)} of checkpoint {found.path} holds {part.numel} x {saved}; {whose} of "
            f"this model would hold {want} x {dtype} (a different model?)",
            found.path,
        )
    return intervals


def _read_array(
    found: Manifest, reader: _PartReader, name: str, target: torch.Tensor | ArraySink, pieces: list[_Piece]
) -> None:
    """Every range ``target`` holds, in its own element order, from the pieces that hold it."""
    _, intervals = placement(target)
    starts = [piece.start for piece in pieces]
    itemsize = target.dtype.itemsize
    into = as_bytes(target) if isinstance(target, torch.Tensor) else None
    sink = None if isinstance(target, torch.Tensor) else target
    position = 0  # the target's element where the current range begins
    for lo, hi in intervals:
        cursor = lo
        while cursor < hi:
            index = bisect.bisect_right(starts, cursor) - 1
            if index < 0 or pieces[index].stop <= cursor:
                raise CheckpointCorrupt(
                    f"checkpoint {found.path} holds no element {cursor} of {name}, which this process needs (a "
                    "checkpoint of one rank's shards alone?)"
                )
            piece = pieces[index]
            stop = min(hi, piece.stop)
            base = position + cursor - lo
            window = None if into is None else into[base * itemsize : (base + stop - cursor) * itemsize]

            def deliver(offset: int, data: torch.Tensor, base: int = base) -> None:
                assert sink is not None
                sink.write_from(base + offset, data.view(sink.dtype))

            reader.read(piece.part, name, itemsize, piece.first + cursor - piece.start, stop - cursor, window, deliver)
            cursor = stop
        position += hi - lo
