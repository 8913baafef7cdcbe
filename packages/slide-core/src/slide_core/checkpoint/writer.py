"""Saving a checkpoint: every rank writes one shard file, rank 0 publishes them under one manifest.

Writes go to a hidden staging directory beside the final one (``.tmp-step-NNNNNNNN``); every file and the
directory are fsynced, then one ``rename`` publishes it. A save killed at any point leaves either the new
checkpoint complete or only a staging directory that loading ignores and pruning removes, so the previous
checkpoint stays usable.

Note [One shard per rank]: rank K of N writes ``shard-K-of-N.bin``, its part of every array in turn
(the master, then each optimizer state), and beside it a small record of what it wrote (each part's
offset, ranges of the whole array and block CRC32s). After a barrier rank 0 folds the records into
``state.json``, removes them and renames the directory into place; a second barrier holds every rank
until the checkpoint is published, so a rank-0 failure stops the others at once (Note [Collective
failures] in distributed.py). One process is the case N = 1: one shard covering every array, no record
and no barrier.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

from . import manifest
from .arrays import ArraySource, as_bytes, placement
from .catalog import CHECKPOINT_PREFIX, list_checkpoints
from .errors import CheckpointWriteError
from .manifest import FORMAT, STATE_FILE, checksum, shard_file_name

__all__ = ["CheckpointGroup", "checkpoint_nbytes", "format_size", "save_checkpoint"]

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class CheckpointGroup(Protocol):
    """The ranks that save one checkpoint together (a ``ProcessGroupContext``)."""

    rank: int
    world_size: int

    def barrier(self, what: str, *, slow: bool = False) -> None: ...


def save_checkpoint(
    root: Path,
    step: int,
    arrays: Mapping[str, torch.Tensor | ArraySource],
    extra: Mapping[str, Any],
    group: CheckpointGroup | None = None,
) -> Path:
    """Write ``arrays`` (name -> flat host tensor or :class:`ArraySource`, whole or this rank's
    :class:`~.arrays.Shard`) and ``extra`` (the run state) as ``root/step-NNNNNNNN``, atomically. With a
    ``group`` every rank calls it with its own shards (Note [One shard per rank]). A source is read
    through one 256 MiB buffer, so saving it takes no more host memory than that, whatever its size.
    Raises :class:`CheckpointWriteError` when the disk refuses, naming the checkpoint that is kept; when
    the disk is full, with the bytes the whole checkpoint needs and those free at ``root``
    (:func:`checkpoint_nbytes`)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a checkpoint step must be an integer >= 0, got {step!r}")
    rank, world_size = (0, 1) if group is None else (group.rank, group.world_size)
    final = root / f"{CHECKPOINT_PREFIX}{step:08d}"
    alone = world_size == 1
    staging = root / (f".tmp-{final.name}-{os.getpid()}" if alone else f".tmp-{final.name}")
    shard = staging / shard_file_name(rank, world_size)
    previous = [p for p in list_checkpoints(root) if p != final]
    try:
        root.mkdir(parents=True, exist_ok=True)
        if alone and staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(exist_ok=True)
        infos, record = _write_shard(shard, arrays)
        if group is not None:
            if not alone:
                _write_json(shard.with_suffix(".json"), {"step": step, "arrays": infos, "shard": record})
            group.barrier(f"the wait for every rank's checkpoint shards of step {step}", slow=True)
        if rank == 0:
            records = [record, *(_rank_record(staging, r, world_size, step, infos) for r in range(1, world_size))]
            _publish(staging, final, step, infos, records, extra)
        if group is not None:
            group.barrier(f"the publication of the checkpoint of step {step}", slow=True)
    except OSError as error:
        _clean(staging, shard, alone)
        space = ""
        if error.errno in _NO_SPACE:
            with contextlib.suppress(OSError):
                free = shutil.disk_usage(root if root.exists() else root.parent).free  # after the clean-up
                space = f" (needs {format_size(checkpoint_nbytes(arrays, extra))}, {format_size(free)} free at {root})"
        kept = f"the previous checkpoint {previous[-1]} is kept" if previous else "no earlier checkpoint exists"
        raise CheckpointWriteError(
            error.errno, f"cannot write checkpoint {final}: {error.strerror or error}{space}; {kept}"
        ) from error
    except BaseException:
        _clean(staging, shard, alone)
        raise
    return final


def _clean(staging: Path, shard: Path, alone: bool) -> None:
    """After a failed save: the staging directory when this process owns it, else this rank's files."""
    if alone:
        shutil.rmtree(staging, ignore_errors=True)
        return
    for file in (shard, shard.with_suffix(".json")):
        file.unlink(missing_ok=True)


def checkpoint_nbytes(arrays: Mapping[str, torch.Tensor | ArraySource], extra: Mapping[str, Any]) -> int:
    """Bytes of the whole checkpoint that ``arrays`` and ``extra`` make, every rank's shard file included
    (a rank's ``arrays`` name the whole array each is a shard of) and ``state.json``: what a save needs
    free on the disk. ``state.json`` is estimated from what it lists (``extra``, the block CRCs, a few
    hundred bytes per array): it is KiB beside the shards' GiB."""
    total = 0
    blocks = 0
    for array in arrays.values():
        whole, _ = placement(array)
        nbytes = whole * array.dtype.itemsize
        total += nbytes
        blocks += -(-nbytes // manifest.BLOCK_BYTES)
    return total + len(json.dumps(dict(extra))) + 12 * blocks + 512 * (len(arrays) + 2)


def format_size(nbytes: int) -> str:
    """``nbytes`` as messages say it: in GiB from 1 GiB on, else in MiB, KiB or bytes, so that a small
    checkpoint never reads ``0.00 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _nbytes(array: torch.Tensor | ArraySource) -> int:
    if isinstance(array, torch.Tensor):
        return array.numel() * array.element_size()
    return array.numel * array.dtype.itemsize


def _write_shard(
    file: Path, arrays: Mapping[str, torch.Tensor | ArraySource]
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Write every array's part into ``file`` in turn; return the arrays' ``{dtype, numel}`` and the
    shard's record (``file``, ``bytes``, per array its ``offset``, ``intervals`` and ``crc32``)."""
    infos: dict[str, dict[str, Any]] = {}
    parts: dict[str, dict[str, Any]] = {}
    offset = 0
    buffer: torch.Tensor | None = None
    with file.open("wb") as handle, ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for name, array in arrays.items():
            whole, intervals = placement(array)
            if isinstance(array, torch.Tensor):
                data = as_bytes(array)
                _write(handle, data)
                crcs = _crcs(data, pool)
            else:
                if buffer is None:
                    buffer = torch.empty(manifest.BLOCK_BYTES, dtype=torch.uint8)
                crcs = _write_source(handle, array, buffer)
            infos[name] = {"dtype": str(array.dtype).removeprefix("torch."), "numel": whole}
            parts[name] = {"offset": offset, "intervals": [list(i) for i in intervals], "crc32": crcs}
            offset += _nbytes(array)
        handle.flush()
        os.fsync(handle.fileno())
    return infos, {"file": file.name, "bytes": offset, "parts": parts}


def _write(handle: BinaryIO, data: memoryview) -> None:
    for offset in range(0, len(data), manifest.BLOCK_BYTES):
        handle.write(data[offset : offset + manifest.BLOCK_BYTES])


def _crcs(data: memoryview, pool: ThreadPoolExecutor) -> list[int]:
    # zlib releases the GIL on large buffers, so blocks are checksummed in parallel.
    size = manifest.BLOCK_BYTES
    return list(pool.map(zlib.crc32, [data[offset : offset + size] for offset in range(0, len(data), size)]))


def _write_source(handle: BinaryIO, source: ArraySource, buffer: torch.Tensor) -> list[int]:
    """Write ``source`` block by block through ``buffer``; return the blocks' CRC32s."""
    per_block = manifest.BLOCK_BYTES // source.dtype.itemsize
    crcs = []
    for start in range(0, source.numel, per_block):
        block = buffer.view(source.dtype)[: min(per_block, source.numel - start)]
        source.read_into(start, block)
        data = as_bytes(block)
        handle.write(data)
        crcs.append(zlib.crc32(data))
    return crcs


def _write_json(file: Path, content: Mapping[str, Any], indent: int | None = None) -> None:
    """``content`` as ``file``, fsynced, through a temporary name (a reader never sees half of it)."""
    temp = file.with_name(f".{file.name}.tmp")
    with temp.open("w", encoding="utf-8") as handle:
        handle.write(json.dumps(content, indent=indent))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, file)


def _rank_record(staging: Path, rank: int, world_size: int, step: int, infos: Mapping[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s record of its shard, checked to be of this save (a stale one is refused)."""
    file = staging / shard_file_name(rank, world_size)
    written = json.loads(file.with_suffix(".json").read_text(encoding="utf-8"))
    if written.get("step") != step or written.get("arrays") != json.loads(json.dumps(infos)):
        raise ValueError(f"rank {rank}'s shard of step {step} holds other arrays than rank 0's: {written}")
    record: dict[str, Any] = written["shard"]
    return record


def _publish(
    staging: Path,
    final: Path,
    step: int,
    infos: Mapping[str, Any],
    records: list[dict[str, Any]],
    extra: Mapping[str, Any],
) -> None:
    """Rank 0: the manifest over every rank's ``records``, then the rename that publishes the step."""
    state: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "world_size": len(records),
        "arrays": dict(infos),
        "shards": records,
        "extra": dict(extra),
    }
    state = json.loads(json.dumps(state))  # what a reader will see (tuples as lists, keys as text)
    state["checksum"] = checksum(state)
    _write_json(staging / STATE_FILE, state, indent=1)
    expected = {STATE_FILE, *(record["file"] for record in records)}
    for leftover in staging.iterdir():  # the records, and files of an earlier interrupted save
        if leftover.name in expected:
            continue
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()
    _fsync_dir(staging)
    if final.exists():
        shutil.rmtree(final)
    os.rename(staging, final)
    _fsync_dir(final.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
