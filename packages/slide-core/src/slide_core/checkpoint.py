"""Training checkpoints: the full state, written atomically, verified on load.

Layout of one checkpoint directory (``<output>/checkpoints/step-00000042``)::

    state.json        format (schema) version, step, element count, per-file sizes and per-block CRC32s,
                      the caller's ``extra`` (schedule, data position, RNG, run config), and a SHA-256
                      checksum of all of that
    master.bin        fp32 master weights: HostParameters.slab, raw little-endian
    exp_avg.bin ...   one raw fp32 file per optimizer state tensor, same element order

Writes go to a hidden temporary directory beside the final one; every file and the directory are fsynced,
then one ``rename`` publishes it. A save killed at any point leaves either the new checkpoint complete or
only a temporary directory that loading ignores, so the previous checkpoint stays usable. Loading checks
every file's size and the CRC32 of every 256 MiB block and names the first bad one.

``state.json`` is small and easy to edit by hand, and an edit that keeps it valid JSON (a step, a data
index) would otherwise resume silently into a run that never happened. So it carries a checksum over its
canonical JSON (sorted keys, no spaces, the checksum field left out) and :func:`read_state` refuses any
mismatch, any missing or mistyped field, and bytes that are not UTF-8, naming the field. Format 1
checkpoints predate the checksum; they still load, and a debug log says they were not verified.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import zlib
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "ArraySink",
    "ArraySource",
    "CheckpointCorrupt",
    "CheckpointWriteError",
    "find_latest",
    "list_checkpoints",
    "load_checkpoint",
    "newest_intact",
    "prune_checkpoints",
    "read_state",
    "save_checkpoint",
    "verify_checkpoint",
]

log = logging.getLogger("slide.checkpoint")

FORMAT = 2
"""Version of the ``state.json`` schema: 2 added the checksum. Loading accepts :data:`_READABLE_FORMATS`."""
_READABLE_FORMATS = (1, 2)
_BLOCK_BYTES = 256 * 2**20
_PREFIX = "step-"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class CheckpointCorrupt(ValueError):
    """A checkpoint is incomplete, truncated or fails its checksums; the message names the file.

    ``checkpoint`` is the checkpoint directory at fault (``None`` when none was found at all)."""

    def __init__(self, message: str, checkpoint: Path | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class CheckpointWriteError(OSError):
    """A save failed (full disk, file too large, no permission); the previous checkpoint is untouched."""


@runtime_checkable
class ArraySource(Protocol):
    """A flat array that is not one host tensor (e.g. optimizer state partly on the GPU or on NVMe): the
    save pulls it one block at a time through a single bounded buffer instead of gathering it in RAM."""

    numel: int
    dtype: torch.dtype

    def read_into(self, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` (flat, host) with elements ``[start, start + out.numel())``."""


def _nbytes(array: torch.Tensor | ArraySource) -> int:
    return (
        array.numel * array.dtype.itemsize if isinstance(array, ArraySource) else array.numel() * array.element_size()
    )


def _write_source(path: Path, source: ArraySource, buffer: torch.Tensor) -> list[int]:
    """Write ``source`` block by block through ``buffer``; return the blocks' CRC32s."""
    per_block = _BLOCK_BYTES // source.dtype.itemsize
    crcs = []
    with path.open("wb") as handle:
        for start in range(0, source.numel, per_block):
            block = buffer.view(source.dtype)[: min(per_block, source.numel - start)]
            source.read_into(start, block)
            data = _as_bytes(block)
            handle.write(data)
            crcs.append(zlib.crc32(data))
        handle.flush()
        os.fsync(handle.fileno())
    return crcs


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("checkpoint tensors must be contiguous host tensors")
    return memoryview(tensor.view(torch.uint8).numpy())


def _crcs(data: memoryview, pool: ThreadPoolExecutor) -> list[int]:
    # zlib releases the GIL on large buffers, so blocks are checksummed in parallel.
    blocks = [data[offset : offset + _BLOCK_BYTES] for offset in range(0, len(data), _BLOCK_BYTES)]
    return list(pool.map(zlib.crc32, blocks))


def _write(path: Path, data: memoryview) -> None:
    with path.open("wb") as handle:
        for offset in range(0, len(data), _BLOCK_BYTES):
            handle.write(data[offset : offset + _BLOCK_BYTES])
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: Path,
    step: int,
    tensors: Mapping[str, torch.Tensor | ArraySource],
    extra: Mapping[str, Any],
) -> Path:
    """Write ``tensors`` (name -> flat host tensor or :class:`ArraySource`) and ``extra`` as
    ``root/step-NNNNNNNN``, atomically. A source is read through one 256 MiB buffer, so saving it takes
    no more host memory than that, whatever its size."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a checkpoint step must be an integer >= 0, got {step!r}")
    final = root / f"{_PREFIX}{step:08d}"
    temp = root / f".tmp-{final.name}-{os.getpid()}"
    previous = [p for p in list_checkpoints(root) if p != final]
    files: dict[str, Any] = {}
    try:
        root.mkdir(parents=True, exist_ok=True)
        if temp.exists():
            shutil.rmtree(temp)
        temp.mkdir()
        buffer: torch.Tensor | None = None
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            for name, tensor in tensors.items():
                filename = f"{name}.bin"
                if isinstance(tensor, ArraySource):
                    if buffer is None:
                        buffer = torch.empty(_BLOCK_BYTES, dtype=torch.uint8)
                    crcs, numel = _write_source(temp / filename, tensor, buffer), tensor.numel
                else:
                    data = _as_bytes(tensor)
                    _write(temp / filename, data)
                    crcs, numel = _crcs(data, pool), tensor.numel()
                files[filename] = {
                    "bytes": _nbytes(tensor),
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                    "numel": numel,
                    "crc32": crcs,
                }
        state: dict[str, Any] = {"format": FORMAT, "step": step, "files": files, "extra": dict(extra)}
        state = json.loads(json.dumps(state))  # what a reader will see (tuples as lists, keys as text)
        state["checksum"] = _checksum(state)
        (temp / "state.json").write_text(json.dumps(state, indent=1), encoding="utf-8")
        with (temp / "state.json").open("rb") as handle:
            os.fsync(handle.fileno())
        _fsync_dir(temp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(temp, final)
        _fsync_dir(root)
    except OSError as error:
        shutil.rmtree(temp, ignore_errors=True)
        space = ""
        if error.errno in _NO_SPACE:
            needed = sum(_nbytes(t) for t in tensors.values())
            with contextlib.suppress(OSError):
                space = f" (needs {needed / 2**30:.2f} GiB, {shutil.disk_usage(root).free / 2**30:.2f} GiB free)"
        kept = f"the previous checkpoint {previous[-1]} is kept" if previous else "no earlier checkpoint exists"
        raise CheckpointWriteError(
            error.errno, f"cannot write checkpoint {final}: {error.strerror or error}{space}; {kept}"
        ) from error
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints directly under ``root``, oldest first. Temporary directories and folders of
    any other name (such as the ``abandoned-*`` lines a rollback sets aside) are ignored."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / "state.json").exists()]
    return sorted(found, key=lambda p: p.name)


def find_latest(path: Path) -> Path:
    """``path`` itself if it is a checkpoint; else the newest checkpoint of an output directory."""
    if (path / "state.json").exists():
        return path
    for root in (path / "checkpoints", path):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise CheckpointCorrupt(f"no checkpoint found in {path} (looked for {path}/checkpoints/step-*/state.json)")


def newest_intact(corrupt: Path) -> Path | None:
    """The newest checkpoint older than ``corrupt`` in the same folder that passes
    :func:`verify_checkpoint` (every file read and checked), or ``None``. Meant for the message that
    follows a corrupt checkpoint, so it is as slow as reading those checkpoints once."""
    older = [p for p in list_checkpoints(corrupt.parent) if p.name < corrupt.name]
    for candidate in reversed(older):
        try:
            verify_checkpoint(candidate)
        except CheckpointCorrupt:
            continue
        return candidate
    return None


def prune_checkpoints(root: Path, keep: int, *, protect: Collection[Path] = ()) -> None:
    """Delete all but the newest ``keep`` checkpoints, and leftovers of interrupted saves. Checkpoints in
    ``protect`` (the best one by evaluation loss) stay and do not count against ``keep``."""
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    kept = {Path(p).resolve() for p in protect}
    candidates = [p for p in list_checkpoints(root) if p.resolve() not in kept]
    for old in candidates[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


@runtime_checkable
class ArraySink(Protocol):
    """The mirror of :class:`ArraySource` for loading: each verified block is handed over to be put where
    its elements live (host, GPU, a storage tier), so a load needs one bounded buffer, not the array."""

    numel: int
    dtype: torch.dtype

    def write_from(self, start: int, block: torch.Tensor) -> None:
        """Store ``block`` (flat, host) as elements ``[start, start + block.numel())``."""


def _read_sink(path: Path, file: Path, sink: ArraySink, crcs: list[int], buffer: torch.Tensor) -> None:
    """Read ``file`` block by block through ``buffer``; each block is checked before the sink sees it."""
    per_block = _BLOCK_BYTES // sink.dtype.itemsize
    with file.open("rb") as handle:
        for index, start in enumerate(range(0, sink.numel, per_block)):
            block = buffer.view(sink.dtype)[: min(per_block, sink.numel - start)]
            data = _as_bytes(block)
            handle.readinto(data)
            if zlib.crc32(data) != crcs[index]:
                raise _bad_block(path, file, index)
            sink.write_from(start, block)


def _checksum(state: Mapping[str, Any]) -> str:
    """SHA-256 of ``state``'s canonical JSON, without its own ``checksum`` field."""
    body = {key: value for key, value in state.items() if key != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def read_state(path: Path) -> dict[str, Any]:
    """The verified ``state.json`` of checkpoint ``path``.

    Raises :class:`CheckpointCorrupt` naming the problem: unreadable or non-UTF-8 bytes, invalid JSON, an
    unknown format, a checksum mismatch (an edit), or a missing or mistyped field (``step``, ``files``
    and each file's ``bytes``, ``dtype``, ``numel``, ``crc32``, ``extra``). The caller's ``extra`` is
    checked only for being an object: its fields are the caller's to validate."""
    file = path / "state.json"

    def corrupt(detail: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"checkpoint {path} is corrupt ({detail})", path)

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
    if not isinstance(state, dict):
        raise corrupt("state.json holds no JSON object")
    version = state.get("format")
    if version not in _READABLE_FORMATS or isinstance(version, bool):
        raise corrupt(f"state.json field format is {version!r}; this version reads {_READABLE_FORMATS}")
    if version >= 2:
        if not isinstance(state.get("checksum"), str):
            raise corrupt("state.json field checksum is missing")
        if state["checksum"] != _checksum(state):
            raise corrupt("state.json fails its checksum: it was edited or damaged after the save")
    else:
        log.debug("%s predates state.json checksums (format %d); its fields are checked but not verified", path, 1)
    if not _is_int(state.get("step")):
        raise corrupt(f"state.json field step must be an integer >= 0, got {state.get('step')!r}")
    files = state.get("files")
    if not isinstance(files, dict):
        raise corrupt("state.json field files must be an object")
    for name, meta in files.items():
        _check_file_meta(name, meta, corrupt)
    if not isinstance(state.get("extra"), dict):
        raise corrupt("state.json field extra must be an object")
    return state


def _check_file_meta(name: str, meta: Any, corrupt: Any) -> None:
    where = f"state.json field files.{name}"
    if not isinstance(meta, dict):
        raise corrupt(f"{where} must be an object")
    for key in ("bytes", "numel"):
        if not _is_int(meta.get(key)):
            raise corrupt(f"{where}.{key} must be an integer >= 0, got {meta.get(key)!r}")
    dtype = getattr(torch, str(meta.get("dtype")), None)
    if not isinstance(meta.get("dtype"), str) or not isinstance(dtype, torch.dtype):
        raise corrupt(f"{where}.dtype must name a torch dtype, got {meta.get('dtype')!r}")
    if meta["bytes"] != meta["numel"] * dtype.itemsize:
        raise corrupt(f"{where}.bytes is {meta['bytes']}, but {meta['numel']} x {meta['dtype']} is not that")
    crcs = meta.get("crc32")
    blocks = -(-meta["bytes"] // _BLOCK_BYTES)
    if not isinstance(crcs, list) or len(crcs) != blocks or not all(_is_int(c) for c in crcs):
        raise corrupt(f"{where}.crc32 must list {blocks} block checksum(s)")


def verify_checkpoint(path: Path) -> None:
    """Check all of checkpoint ``path`` without loading it anywhere: its state, every file's size and
    every block's CRC32, read through one bounded buffer. Raises :class:`CheckpointCorrupt`."""
    state = read_state(path)
    files = state["files"]
    buffer = memoryview(bytearray(min(_BLOCK_BYTES, max((m["bytes"] for m in files.values()), default=0))))
    for filename, meta in files.items():
        file = _sized_file(path, filename, meta)
        with file.open("rb") as handle:
            for index, want in enumerate(meta["crc32"]):
                got = handle.readinto(buffer)
                if zlib.crc32(buffer[:got]) != want:
                    raise _bad_block(path, file, index)


def _sized_file(path: Path, filename: str, meta: Mapping[str, Any]) -> Path:
    file = path / filename
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise CheckpointCorrupt(f"checkpoint {path} is corrupt ({filename} is missing)", path) from None
    if size != meta["bytes"]:
        raise CheckpointCorrupt(
            f"checkpoint {path} is corrupt ({filename} is {size} bytes, expected {meta['bytes']}: truncated?)", path
        )
    return file


def _bad_block(path: Path, file: Path, index: int) -> CheckpointCorrupt:
    return CheckpointCorrupt(
        f"checkpoint {path} is corrupt ({file.name} fails its checksum in block {index}, bytes "
        f"{index * _BLOCK_BYTES}+)",
        path,
    )


def load_checkpoint(path: Path, tensors: Mapping[str, torch.Tensor | ArraySink]) -> dict[str, Any]:
    """Verify ``path`` and read it into ``tensors`` (same names, numel and dtype; host tensors, or
    :class:`ArraySink` s that receive it block by block, each block verified first); return its state."""
    state = read_state(path)
    files = state["files"]
    buffer: torch.Tensor | None = None
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for name, tensor in tensors.items():
            filename = f"{name}.bin"
            meta = files.get(filename)
            if meta is None:
                raise CheckpointCorrupt(f"checkpoint {path} is corrupt (state.json lists no {filename})", path)
            sink = tensor if isinstance(tensor, ArraySink) else None
            numel = sink.numel if sink is not None else tensor.numel()
            if meta["numel"] != numel or meta["dtype"] != str(tensor.dtype).removeprefix("torch."):
                raise CheckpointCorrupt(
                    f"{path / filename} holds {meta['numel']} x {meta['dtype']}; this run needs "
                    f"{numel} x {tensor.dtype} (a different model?)"
                )
            file = _sized_file(path, filename, meta)
            if sink is not None:
                if buffer is None:
                    buffer = torch.empty(_BLOCK_BYTES, dtype=torch.uint8)
                _read_sink(path, file, sink, meta["crc32"], buffer)
                continue
            data = _as_bytes(tensor)
            with file.open("rb") as handle:
                for offset in range(0, len(data), _BLOCK_BYTES):
                    handle.readinto(data[offset : offset + _BLOCK_BYTES])
            crcs = _crcs(data, pool)
            for block, (got, want) in enumerate(zip(crcs, meta["crc32"], strict=True)):
                if got != want:
                    raise _bad_block(path, file, block)
    return state
