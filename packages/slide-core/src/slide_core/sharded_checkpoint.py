"""Data-parallel checkpoints: every rank's shards under one step directory, read back at any world size.

Layout of one step (``<output>/checkpoints/step-00000042``), written by N ranks::

    state.json    the manifest: a slide_core checkpoint with no arrays whose ``extra`` is the caller's
                  plus ``world_size`` (N) and ``ranks`` (the rank folders, in rank order)
    rank-0/       rank 0's checkpoint (checkpoint.py's format): for every array (the master, each
    rank-1/       optimizer state) its shard ``shard_span(n, k, N)`` of every unit, in slab order

A single-process checkpoint is the same thing with N = 1 and the arrays in the step directory itself:
every unit whole, in slab order.

:func:`save_sharded_checkpoint` publishes all ranks' folders with one rename (rank 0 moves them under the
manifest after a barrier), so a step directory holds every rank's shards or does not exist.

:func:`load_resharded` is how a run of M ranks resumes a checkpoint of N (any N, M >= 1): rank r needs
``shard_span(n, r, M)`` of every unit, and reads each part of it from the old rank whose shard holds it,
in the order its sinks take it (unit by unit, each unit's range in order). Only the blocks of the old
files that overlap what this rank needs are read and checked: the first time a 256 MiB block is touched
it is read whole and its CRC32 compared with the file's record before any of it is handed over; a later
piece of an already verified block reads its own bytes only. One block-sized buffer is all it holds.
"""

from __future__ import annotations

import os
import shutil
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slide_core.checkpoint import (
    _BLOCK_BYTES,
    ArraySink,
    CheckpointCorrupt,
    _bad_block,
    _sized_file,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from slide_core.distributed import shard_span

if TYPE_CHECKING:
    from slide_core.checkpoint import ArraySource
    from slide_core.distributed import ProcessGroupContext

__all__ = ["ShardedLayout", "load_gathered", "load_resharded", "save_sharded_checkpoint", "sharded_layout"]


def save_sharded_checkpoint(
    root: Path,
    step: int,
    arrays: Mapping[str, torch.Tensor | ArraySource],
    extra: Mapping[str, Any],
    group: ProcessGroupContext,
) -> Path:
    """Every rank's ``arrays`` (its shards, ``Engine.checkpoint_arrays``) as ``root/step-NNNNNNNN/rank-R``
    under one manifest, published at once; every rank must call it. Each rank saves under a hidden staging
    folder; after a barrier rank 0 writes the manifest, moves every rank folder under it and renames the
    whole step directory into place. An interrupted save leaves only the ``.tmp-`` staging folder, which
    ``prune_checkpoints`` removes. Every rank waits for the publication, so a rank-0 failure stops the
    others at once (Note [Collective failures] in distributed.py)."""
    staging = root / f".tmp-dp-step-{step:08d}"
    save_checkpoint(staging / f"rank-{group.rank}", step, arrays, extra)
    group.barrier(f"the wait for every rank's checkpoint shards of step {step}", slow=True)
    final = root / f"step-{step:08d}"
    if group.rank == 0:
        ranks = [f"rank-{rank}" for rank in range(group.world_size)]
        manifest_dir = save_checkpoint(
            staging / "manifest", step, {}, {**extra, "world_size": group.world_size, "ranks": ranks}
        )
        for rank_dir in ranks:
            os.rename(staging / rank_dir / final.name, manifest_dir / rank_dir)
        if final.exists():
            shutil.rmtree(final)
        os.rename(manifest_dir, final)
        shutil.rmtree(staging, ignore_errors=True)
    group.barrier(f"the publication of the checkpoint of step {step}", slow=True)
    return final


@dataclass(frozen=True)
class ShardedLayout:
    """Who wrote a checkpoint: ``world_size`` ranks, rank k's arrays in ``rank_dirs[k]`` (the step
    directory itself for a single-process checkpoint), and the verified ``state`` of the step directory
    (the manifest's, or the single checkpoint's)."""

    path: Path
    world_size: int
    rank_dirs: tuple[Path, ...]
    state: dict[str, Any]

    @property
    def is_manifest(self) -> bool:
        return self.rank_dirs != (self.path,)


def sharded_layout(path: Path) -> ShardedLayout:
    """The layout of checkpoint ``path``: a data-parallel manifest, or a single-process checkpoint (one
    rank). Raises :class:`CheckpointCorrupt` naming a bad manifest field."""
    state = read_state(path)
    extra = state["extra"]
    if "world_size" not in extra and "ranks" not in extra:
        return ShardedLayout(path, 1, (path,), state)
    world_size, ranks = extra.get("world_size"), extra.get("ranks")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointCorrupt(
            f"checkpoint {path} is corrupt (state.json field extra.world_size must be an integer >= 1, "
            f"got {world_size!r})",
            path,
        )
    names_ok = isinstance(ranks, list) and all(isinstance(r, str) and r and "/" not in r for r in ranks)
    if not names_ok or len(ranks) != world_size:
        raise CheckpointCorrupt(
            f"checkpoint {path} is corrupt (state.json field extra.ranks must name {world_size} rank folders, "
            f"got {ranks!r})",
            path,
        )
    return ShardedLayout(path, world_size, tuple(path / name for name in ranks), state)


@dataclass(frozen=True)
class _Piece:
    """``count`` elements of the target, from old rank ``source``'s file at element ``offset``."""

    source: int
    offset: int
    count: int


def _pieces(numels: Sequence[int], rank: int, world_size: int, old_world_size: int) -> list[_Piece]:
    """What rank ``rank`` of ``world_size`` reads, in its own element order: for every unit its new shard,
    part by part from each old rank whose shard overlaps it."""
    pieces: list[_Piece] = []
    old_starts = [0] * old_world_size  # where each unit's shard begins in each old rank's file
    for numel in numels:
        lo, hi = shard_span(numel, rank, world_size)
        for source in range(old_world_size):
            old_lo, old_hi = shard_span(numel, source, old_world_size)
            a, b = max(lo, old_lo), min(hi, old_hi)
            if a < b:
                pieces.append(_Piece(source, old_starts[source] + a - old_lo, b - a))
            old_starts[source] += old_hi - old_lo
    return pieces


def _shard_numel(numels: Sequence[int], rank: int, world_size: int) -> int:
    return sum(hi - lo for lo, hi in (shard_span(numel, rank, world_size) for numel in numels))


class _VerifiedReader:
    """Reads element ranges out of one array's per-rank files, each 256 MiB block checked against its
    CRC32 the first time any of it is read (see the module docstring)."""

    def __init__(self, files: Sequence[Path], crcs: Sequence[Sequence[int]], dtype: torch.dtype) -> None:
        self.files, self.crcs, self.dtype = files, crcs, dtype
        self.itemsize = dtype.itemsize
        self.buffer = torch.empty(_BLOCK_BYTES, dtype=torch.uint8)
        self.verified: set[tuple[int, int]] = set()
        self.handles: dict[int, Any] = {}

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()
        self.handles.clear()

    def read(self, piece: _Piece, sink: ArraySink, target: int) -> None:
        """Hand ``piece`` to ``sink`` as its elements from ``target`` on, block by block."""
        handle = self.handles.get(piece.source)
        if handle is None:
            handle = self.handles[piece.source] = self.files[piece.source].open("rb")
        first, end = piece.offset * self.itemsize, (piece.offset + piece.count) * self.itemsize
        view = memoryview(self.buffer.numpy())
        cursor = first
        while cursor < end:
            block = cursor // _BLOCK_BYTES
            block_start = block * _BLOCK_BYTES
            stop = min(end, block_start + _BLOCK_BYTES)
            if (piece.source, block) not in self.verified:
                handle.seek(block_start)
                got = handle.readinto(view)
                if zlib.crc32(view[:got]) != self.crcs[piece.source][block]:
                    raise _bad_block(self.files[piece.source].parent, self.files[piece.source], block)
                self.verified.add((piece.source, block))
                data = self.buffer[cursor - block_start : stop - block_start]
            else:
                handle.seek(cursor)
                handle.readinto(view[: stop - cursor])
                data = self.buffer[: stop - cursor]
            sink.write_from(target + (cursor - first) // self.itemsize, data.view(self.dtype))
            cursor = stop


def load_resharded(
    path: Path, sinks: Mapping[str, ArraySink], numels: Sequence[int], rank: int, world_size: int
) -> dict[str, Any]:
    """Read checkpoint ``path`` (a data-parallel step directory of any world size, or a single-process
    checkpoint) into ``sinks``: rank ``rank`` of ``world_size`` gets, for each array name, its shard
    ``shard_span(n, rank, world_size)`` of every unit (``numels``: the units' element counts in slab
    order), concatenated in slab order -- what ``Engine.checkpoint_arrays`` of that rank would hold.
    Returns the verified state of the step directory (the manifest's ``extra`` is the run state).

    Raises :class:`CheckpointCorrupt` naming the first bad thing: a missing rank folder or file, a file
    of the wrong size or element count (another model), a block that fails its checksum. Its
    ``checkpoint`` is ``path`` even when a rank's folder is at fault: the step is what a run falls back
    from."""
    try:
        return _load_resharded(path, sinks, numels, rank, world_size)
    except CheckpointCorrupt as error:
        if error.checkpoint == path:
            raise
        raise CheckpointCorrupt(str(error), path) from None


def _load_resharded(
    path: Path, sinks: Mapping[str, ArraySink], numels: Sequence[int], rank: int, world_size: int
) -> dict[str, Any]:
    layout = sharded_layout(path)
    old = layout.world_size
    rank_states = []
    for rank_dir in layout.rank_dirs:
        rank_state = layout.state if rank_dir == layout.path else read_state(rank_dir)
        if rank_state["step"] != layout.state["step"]:
            raise CheckpointCorrupt(
                f"checkpoint {path} is corrupt ({rank_dir.name} is of step {rank_state['step']}, "
                f"the manifest of step {layout.state['step']})",
                path,
            )
        rank_states.append(rank_state)
    pieces = _pieces(numels, rank, world_size, old)
    for name, sink in sinks.items():
        filename = f"{name}.bin"
        files, crcs = [], []
        for source, (rank_dir, rank_state) in enumerate(zip(layout.rank_dirs, rank_states, strict=True)):
            meta = rank_state["files"].get(filename)
            if meta is None:
                raise CheckpointCorrupt(f"checkpoint {rank_dir} is corrupt (state.json lists no {filename})", path)
            want = _shard_numel(numels, source, old)
            dtype = str(sink.dtype).removeprefix("torch.")
            if meta["numel"] != want or meta["dtype"] != dtype:
                whose = f"rank {source} of {old}" if old > 1 else "one process"
                raise CheckpointCorrupt(
                    f"{rank_dir / filename} holds {meta['numel']} x {meta['dtype']}; {whose} of this model "
                    f"would hold {want} x {dtype} (a different model?)",
                    path,
                )
            files.append(_sized_file(rank_dir, filename, meta))
            crcs.append(meta["crc32"])
        if sink.numel != _shard_numel(numels, rank, world_size):
            raise ValueError(f"the sink of {name} holds {sink.numel} elements, not rank {rank}'s shards")
        reader = _VerifiedReader(files, crcs, sink.dtype)
        try:
            target = 0
            for piece in pieces:
                reader.read(piece, sink, target)
                target += piece.count
        finally:
            reader.close()
    return layout.state


class _TensorSink:
    """A flat host tensor as an :class:`ArraySink`."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.numel, self.dtype = tensor, tensor.numel(), tensor.dtype

    def write_from(self, start: int, block: torch.Tensor) -> None:
        self.tensor[start : start + block.numel()].copy_(block)


def load_gathered(path: Path, tensors: Mapping[str, torch.Tensor], numels: Sequence[int]) -> dict[str, Any]:
    """Read checkpoint ``path`` whole into host ``tensors`` (name -> every unit in slab order, e.g.
    ``{"master": HostParameters.slab}``), whoever wrote it: a single-process checkpoint directly, a
    data-parallel step directory by streaming each rank's shards into place (what an export of a
    data-parallel run reads). Returns the verified state of the step directory."""
    if not sharded_layout(path).is_manifest:
        return load_checkpoint(path, tensors)
    return load_resharded(path, {name: _TensorSink(tensor) for name, tensor in tensors.items()}, numels, 0, 1)
