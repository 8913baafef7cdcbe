"""The two layouts before the manifest format (``state.json`` formats 1 and 2), read into a
:class:`~.manifest.Manifest` so they load through the one reader.

- A single-process checkpoint: ``state.json`` lists ``files`` (``<name>.bin``: bytes, dtype, numel,
  block CRC32s), one raw file per whole array beside it.
- A data-parallel step directory: ``state.json`` lists no files, its ``extra`` names ``world_size`` and
  the ``ranks`` folders; ``rank-K/`` is a single-process checkpoint of rank K's shards: ``shard_span(n, K,
  N)`` of every unit of ``n`` elements, in slab order. Those ranges need the units' sizes, which such a
  checkpoint does not record: its parts carry ``legacy_rank`` and the loader is given the sizes
  (:func:`legacy_intervals`).

Format 1 predates the checksum; format 2 added it. Nothing here writes either.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .arrays import Interval, normalized
from .errors import CheckpointCorrupt
from .manifest import ArrayInfo, Manifest, Part, dtype_named, is_count, read_state

__all__ = ["legacy_intervals", "legacy_manifest"]


def legacy_manifest(path: Path, state: dict[str, Any]) -> Manifest:
    """The :class:`Manifest` of a format 1 or 2 checkpoint at ``path`` (``state``: its verified state)."""
    extra = state["extra"]
    if "world_size" not in extra and "ranks" not in extra:
        arrays, parts, file_bytes = _files(path, state, None)
        return Manifest(path, state, arrays, parts, file_bytes)
    world_size, ranks = extra.get("world_size"), extra.get("ranks")
    corrupt = Manifest(path, state, {}, {}, {}).corrupt
    if not is_count(world_size, 1):
        raise corrupt(f"state.json field extra.world_size must be an integer >= 1, got {world_size!r}")
    names_ok = isinstance(ranks, list) and all(isinstance(r, str) and r and "/" not in r for r in ranks)
    if not names_ok or len(ranks) != world_size:
        raise corrupt(f"state.json field extra.ranks must name {world_size} rank folders, got {ranks!r}")
    arrays, parts, file_bytes = {}, {}, {}
    for rank, folder in enumerate(ranks):
        try:
            rank_state = read_state(path / folder)
        except CheckpointCorrupt as error:  # the step is what a run falls back from
            raise CheckpointCorrupt(str(error), path) from None
        if rank_state["step"] != state["step"]:
            raise corrupt(f"{folder} is of step {rank_state['step']}, the manifest of step {state['step']}")
        rank_arrays, rank_parts, rank_bytes = _files(path / folder, rank_state, (rank, world_size))
        for name, info in rank_arrays.items():
            arrays.setdefault(name, ArrayInfo(info.dtype, None))
            parts[name] = (*parts.get(name, ()), *rank_parts[name])
        file_bytes.update(rank_bytes)
    return Manifest(path, state, arrays, parts, file_bytes)


def _files(
    folder: Path, state: dict[str, Any], legacy_rank: tuple[int, int] | None
) -> tuple[dict[str, ArrayInfo], dict[str, tuple[Part, ...]], dict[Path, int]]:
    """The arrays of one single-process folder: one file per array, whole unless ``legacy_rank``."""
    arrays: dict[str, ArrayInfo] = {}
    parts: dict[str, tuple[Part, ...]] = {}
    file_bytes: dict[Path, int] = {}
    for filename, meta in state["files"].items():
        name = filename.removesuffix(".bin")
        dtype = dtype_named(meta["dtype"])
        assert dtype is not None  # checked by read_state
        file = folder / filename
        whole = ((0, meta["numel"]),) if legacy_rank is None else None
        arrays[name] = ArrayInfo(dtype, meta["numel"])
        parts[name] = (Part(file, 0, meta["numel"], tuple(meta["crc32"]), whole, legacy_rank),)
        file_bytes[file] = meta["bytes"]
    return arrays, parts, file_bytes


def legacy_intervals(unit_numels: Sequence[int], rank: int, world_size: int) -> tuple[Interval, ...]:
    """The ranges of the whole array that rank ``rank`` of ``world_size`` held in a legacy data-parallel
    checkpoint: its ``shard_span`` of every unit."""
    from slide_core.distributed import shard_span  # distributed.py imports the engine, which imports this

    intervals, start = [], 0
    for numel in unit_numels:
        lo, hi = shard_span(numel, rank, world_size)
        intervals.append((start + lo, start + hi))
        start += numel
    return normalized(intervals)
