"""A checkpoint's ``state.json``, read, verified and turned into where every array's elements are.

``state.json`` is small and easy to edit by hand, and an edit that keeps it valid JSON (a step, a data
index) would otherwise resume silently into a run that never happened. So it carries a checksum over its
canonical JSON (sorted keys, no spaces, the checksum field left out) and :func:`read_state` refuses any
mismatch, any missing or mistyped field, and bytes that are not UTF-8, naming the field.

Format 3 (written now) is the manifest of one shard file per rank; formats 1 and 2 are the layouts before
it, read by legacy.py into the same :class:`Manifest`, so one reader loads all of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .arrays import Interval
from .errors import CheckpointCorrupt

__all__ = [
    "BLOCK_BYTES",
    "FORMAT",
    "STATE_FILE",
    "ArrayInfo",
    "Manifest",
    "Part",
    "checksum",
    "current_manifest",
    "read_state",
    "shard_file_name",
]

log = logging.getLogger("slide.checkpoint")

FORMAT = 3
"""Version of the ``state.json`` schema: 2 added the checksum, 3 the per-rank shard files."""
_READABLE_FORMATS = (1, 2, 3)
BLOCK_BYTES = 256 * 2**20
"""Bytes per CRC32: a file part is checked block by block, so a load verifies what it reads as it reads it.
Read through the module (``manifest.BLOCK_BYTES``) so tests can make blocks small."""
STATE_FILE = "state.json"

Corrupt = Callable[[str], CheckpointCorrupt]


def shard_file_name(rank: int, world_size: int) -> str:
    """The shard file rank ``rank`` of ``world_size`` writes."""
    return f"shard-{rank:05d}-of-{world_size:05d}.bin"


@dataclass(frozen=True)
class ArrayInfo:
    """One array of a checkpoint: its dtype and the whole array's element count (``None`` in a legacy
    data-parallel checkpoint, which did not record it)."""

    dtype: torch.dtype
    numel: int | None


@dataclass(frozen=True)
class Part:
    """One array's elements in one file: ``numel`` elements from byte ``offset``, checked by one CRC32 per
    :data:`BLOCK_BYTES` block from ``offset`` on. ``intervals``: the whole array's ranges it holds, in
    order; ``None`` for a legacy data-parallel shard, whose ranges follow from the units' sizes and
    ``legacy_rank`` (its rank, world size; legacy.py)."""

    file: Path
    offset: int
    numel: int
    crc32: tuple[int, ...]
    intervals: tuple[Interval, ...] | None
    legacy_rank: tuple[int, int] | None = None


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs of checkpoint ``path``: its verified ``state`` (what loads return),
    each array's dtype and size, each array's parts, and each file's expected size in bytes."""

    path: Path
    state: dict[str, Any]
    arrays: dict[str, ArrayInfo]
    parts: dict[str, tuple[Part, ...]]
    file_bytes: dict[Path, int]

    def corrupt(self, detail: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"checkpoint {self.path} is corrupt ({detail})", self.path)

    def name_of(self, file: Path) -> str:
        """``file`` as messages name it: relative to the checkpoint."""
        return file.relative_to(self.path).as_posix()


def checksum(state: Mapping[str, Any]) -> str:
    """SHA-256 of ``state``'s canonical JSON, without its own ``checksum`` field."""
    body = {key: value for key, value in state.items() if key != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


def is_count(value: Any, low: int = 0) -> bool:
    """An integer (not a bool) >= ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def dtype_named(name: Any) -> torch.dtype | None:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def blocks(nbytes: int) -> int:
    """How many CRC32 blocks cover ``nbytes``."""
    return -(-nbytes // BLOCK_BYTES)


def read_state(path: Path) -> dict[str, Any]:
    """The verified ``state.json`` of checkpoint ``path``, with ``world_size`` (how many processes wrote
    it) filled in for every format.

    Raises :class:`CheckpointCorrupt` naming the problem: unreadable or non-UTF-8 bytes, invalid JSON, an
    unknown format, a checksum mismatch (an edit), or a missing or mistyped field. The caller's ``extra``
    is checked only for being an object: its fields are the caller's to validate."""

    def corrupt(detail: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"checkpoint {path} is corrupt ({detail})", path)

    state = _parse(path / STATE_FILE, corrupt)
    version = state.get("format")
    if version not in _READABLE_FORMATS or isinstance(version, bool):
        raise corrupt(f"state.json field format is {version!r}; this version reads {_READABLE_FORMATS}")
    if version >= 2:
        if not isinstance(state.get("checksum"), str):
            raise corrupt("state.json field checksum is missing")
        if state["checksum"] != checksum(state):
            raise corrupt("state.json fails its checksum: it was edited or damaged after the save")
    else:
        log.debug("%s predates state.json checksums (format 1); its fields are checked but not verified", path)
    if not is_count(state.get("step")):
        raise corrupt(f"state.json field step must be an integer >= 0, got {state.get('step')!r}")
    if version == FORMAT:
        _check_manifest_fields(state, corrupt)
    else:
        _check_legacy_fields(state, corrupt)
    if not isinstance(state.get("extra"), dict):
        raise corrupt("state.json field extra must be an object")
    if version < FORMAT:
        state["world_size"] = state["extra"].get("world_size", 1)
    return state


def _parse(file: Path, corrupt: Corrupt) -> dict[str, Any]:
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise corrupt("state.json is missing") from None
    except OSError as error:
        raise corrupt(f"cannot read state.json: {error.strerror or error}") from None
    try:
        state = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise corrupt(f"state.json is not UTF-8 text: byte {error.start} is 0x{raw[error.start]:02x}") from None
    except json.JSONDecodeError as error:
        raise corrupt(f"state.json is not valid JSON: {error.msg} at line {error.lineno}") from None
    except RecursionError:  # brackets nested deeper than the parser's stack: no state.json slide wrote
        raise corrupt("state.json is not valid JSON: it nests arrays or objects too deeply") from None
    if not isinstance(state, dict):
        raise corrupt("state.json holds no JSON object")
    return state


def _check_legacy_fields(state: dict[str, Any], corrupt: Corrupt) -> None:
    """Formats 1 and 2: ``files`` and each file's ``bytes``, ``dtype``, ``numel`` and ``crc32``."""
    files = state.get("files")
    if not isinstance(files, dict):
        raise corrupt("state.json field files must be an object")
    for name, meta in files.items():
        where = f"state.json field files.{name}"
        if not isinstance(meta, dict):
            raise corrupt(f"{where} must be an object")
        for key in ("bytes", "numel"):
            if not is_count(meta.get(key)):
                raise corrupt(f"{where}.{key} must be an integer >= 0, got {meta.get(key)!r}")
        dtype = dtype_named(meta.get("dtype"))
        if dtype is None:
            raise corrupt(f"{where}.dtype must name a torch dtype, got {meta.get('dtype')!r}")
        if meta["bytes"] != meta["numel"] * dtype.itemsize:
            raise corrupt(f"{where}.bytes is {meta['bytes']}, but {meta['numel']} x {meta['dtype']} is not that")
        crcs = meta.get("crc32")
        count = blocks(meta["bytes"])
        if not isinstance(crcs, list) or len(crcs) != count or not all(is_count(c) for c in crcs):
            raise corrupt(f"{where}.crc32 must list {count} block checksum(s)")


def _check_manifest_fields(state: dict[str, Any], corrupt: Corrupt) -> None:
    """Format 3: ``world_size``, ``arrays`` (dtype, numel each) and ``shards`` (per rank its file, size
    and per array its offset, ranges and block CRC32s), each field named when wrong."""
    world_size = state.get("world_size")
    if not is_count(world_size, 1):
        raise corrupt(f"state.json field world_size must be an integer >= 1, got {world_size!r}")
    arrays = state.get("arrays")
    if not isinstance(arrays, dict):
        raise corrupt("state.json field arrays must be an object")
    for name, info in arrays.items():
        where = f"state.json field arrays.{name}"
        if not isinstance(info, dict) or dtype_named(info.get("dtype")) is None:
            raise corrupt(f"{where}.dtype must name a torch dtype")
        if not is_count(info.get("numel")):
            raise corrupt(f"{where}.numel must be an integer >= 0, got {info.get('numel')!r}")
    shards = state.get("shards")
    if not isinstance(shards, list) or len(shards) != world_size:
        raise corrupt(f"state.json field shards must list {world_size} shard(s)")
    for rank, shard in enumerate(shards):
        _check_shard(f"state.json field shards[{rank}]", shard, arrays, corrupt)


def _check_shard(where: str, shard: Any, arrays: dict[str, Any], corrupt: Corrupt) -> None:
    if not isinstance(shard, dict):
        raise corrupt(f"{where} must be an object")
    file = shard.get("file")
    if not isinstance(file, str) or not file or "/" in file or file.startswith("."):
        raise corrupt(f"{where}.file must name a file of the checkpoint, got {file!r}")
    parts = shard.get("parts")
    if not isinstance(parts, dict):
        raise corrupt(f"{where}.parts must be an object")
    offset = 0
    for name, part in parts.items():
        at = f"{where}.parts.{name}"
        if name not in arrays or not isinstance(part, dict):
            raise corrupt(f"{at} is no part of an array the checkpoint lists")
        if part.get("offset") != offset:
            raise corrupt(f"{at}.offset must be {offset}, got {part.get('offset')!r}")
        intervals = part.get("intervals")
        numel = _checked_intervals(intervals, arrays[name]["numel"])
        if numel is None:
            raise corrupt(f"{at}.intervals must list ordered ranges [start, stop) of the array, got {intervals!r}")
        dtype = dtype_named(arrays[name]["dtype"])
        assert dtype is not None  # checked with the arrays
        nbytes = numel * dtype.itemsize
        crcs = part.get("crc32")
        if not isinstance(crcs, list) or len(crcs) != blocks(nbytes) or not all(is_count(c) for c in crcs):
            raise corrupt(f"{at}.crc32 must list {blocks(nbytes)} block checksum(s)")
        offset += nbytes
    if shard.get("bytes") != offset:
        raise corrupt(f"{where}.bytes must be {offset} (the sum of its parts), got {shard.get('bytes')!r}")


def _checked_intervals(intervals: Any, whole: int) -> int | None:
    """The elements ``intervals`` hold if they are ordered, disjoint ranges within ``whole``, else None."""
    if not isinstance(intervals, list):
        return None
    total, end = 0, 0
    for interval in intervals:
        if not (isinstance(interval, list) and len(interval) == 2 and all(is_count(v) for v in interval)):
            return None
        start, stop = interval
        if not end <= start < stop <= whole:
            return None
        total, end = total + stop - start, stop
    return total


def current_manifest(path: Path, state: dict[str, Any]) -> Manifest:
    """The :class:`Manifest` of a checkpoint of the current format at ``path`` (``state``: its verified
    state, :func:`read_state`). Older formats are legacy.py's; the reader chooses."""
    arrays: dict[str, ArrayInfo] = {}
    for name, info in state["arrays"].items():
        dtype = dtype_named(info["dtype"])
        assert dtype is not None  # checked by read_state
        arrays[name] = ArrayInfo(dtype, info["numel"])
    parts: dict[str, list[Part]] = {name: [] for name in arrays}
    file_bytes: dict[Path, int] = {}
    for shard in state["shards"]:
        file = path / shard["file"]
        file_bytes[file] = shard["bytes"]
        for name, part in shard["parts"].items():
            intervals = tuple((start, stop) for start, stop in part["intervals"])
            numel = sum(stop - start for start, stop in intervals)
            parts[name].append(Part(file, part["offset"], numel, tuple(part["crc32"]), intervals))
    return Manifest(path, state, arrays, {name: tuple(p) for name, p in parts.items()}, file_bytes)
