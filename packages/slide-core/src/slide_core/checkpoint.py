"""Training checkpoints: the full state, written atomically, verified on load.

Layout of one checkpoint directory (``<output>/checkpoints/step-00000042``)::

    state.json        format version, step, element count, per-file sizes and per-block CRC32s,
                      plus the caller's ``extra`` (schedule, data position, RNG, run config)
    master.bin        fp32 master weights: HostParameters.slab, raw little-endian
    exp_avg.bin ...   one raw fp32 file per optimizer state tensor, same element order

Writes go to a hidden temporary directory beside the final one; every file and the directory are fsynced,
then one ``rename`` publishes it. A save killed at any point leaves either the new checkpoint complete or
only a temporary directory that loading ignores, so the previous checkpoint stays usable. Loading checks
every file's size and the CRC32 of every 256 MiB block and names the first bad one.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Mapping
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
    "prune_checkpoints",
    "save_checkpoint",
]

FORMAT = 1
_BLOCK_BYTES = 256 * 2**20
_PREFIX = "step-"


class CheckpointCorrupt(ValueError):
    """A checkpoint is incomplete, truncated or fails its checksums; the message names the file."""


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
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:08d}"
    temp = root / f".tmp-{final.name}-{os.getpid()}"
    if temp.exists():
        shutil.rmtree(temp)
    temp.mkdir()
    files: dict[str, Any] = {}
    try:
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
        state = {"format": FORMAT, "step": step, "files": files, "extra": dict(extra)}
        (temp / "state.json").write_text(json.dumps(state, indent=1))
        with (temp / "state.json").open("rb") as handle:
            os.fsync(handle.fileno())
        _fsync_dir(temp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(temp, final)
        _fsync_dir(root)
    except OSError as error:
        shutil.rmtree(temp, ignore_errors=True)
        needed = sum(_nbytes(t) for t in tensors.values())
        free = shutil.disk_usage(root).free
        raise CheckpointWriteError(
            error.errno,
            f"cannot write checkpoint {final}: {error.strerror or error} "
            f"(needs {needed / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free); the previous checkpoint is kept",
        ) from error
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints under ``root``, oldest first (temporary directories are ignored)."""
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


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints, and leftovers of interrupted saves."""
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


@runtime_checkable
class ArraySink(Protocol):
    """The mirror of :class:`ArraySource` for loading: each verified block is handed over to be put where
    its elements live (host, GPU, a storage tier), so a load needs one bounded buffer, not the array."""

    numel: int
    dtype: torch.dtype

    def write_from(self, start: int, block: torch.Tensor) -> None:
        """Store ``block`` (flat, host) as elements ``[start, start + block.numel())``."""


def _read_sink(file: Path, sink: ArraySink, crcs: list[int], buffer: torch.Tensor) -> None:
    """Read ``file`` block by block through ``buffer``; each block is checked before the sink sees it."""
    per_block = _BLOCK_BYTES // sink.dtype.itemsize
    with file.open("rb") as handle:
        for index, start in enumerate(range(0, sink.numel, per_block)):
            block = buffer.view(sink.dtype)[: min(per_block, sink.numel - start)]
            data = _as_bytes(block)
            handle.readinto(data)
            if zlib.crc32(data) != crcs[index]:
                raise CheckpointCorrupt(
                    f"{file} fails its checksum in block {index} (bytes {index * _BLOCK_BYTES}+); "
                    "the checkpoint is corrupt"
                )
            sink.write_from(start, block)


def load_checkpoint(path: Path, tensors: Mapping[str, torch.Tensor | ArraySink]) -> dict[str, Any]:
    """Verify ``path`` and read it into ``tensors`` (same names, numel and dtype; host tensors, or
    :class:`ArraySink` s that receive it block by block, each block verified first); return its state."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointCorrupt(f"{path / 'state.json'} is unreadable: {error}") from None
    if state.get("format") != FORMAT:
        raise CheckpointCorrupt(f"{path} has checkpoint format {state.get('format')!r}, expected {FORMAT}")
    files = state.get("files", {})
    buffer: torch.Tensor | None = None
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for name, tensor in tensors.items():
            filename = f"{name}.bin"
            meta = files.get(filename)
            if meta is None:
                raise CheckpointCorrupt(f"{path} has no {filename}")
            sink = tensor if isinstance(tensor, ArraySink) else None
            numel = sink.numel if sink is not None else tensor.numel()
            if meta["numel"] != numel or meta["dtype"] != str(tensor.dtype).removeprefix("torch."):
                raise CheckpointCorrupt(
                    f"{path / filename} holds {meta['numel']} x {meta['dtype']}; this run needs "
                    f"{numel} x {tensor.dtype} (a different model?)"
                )
            file = path / filename
            size = file.stat().st_size if file.exists() else -1
            if size != meta["bytes"]:
                raise CheckpointCorrupt(f"{file} is {size} bytes, expected {meta['bytes']} (truncated?)")
            if sink is not None:
                if buffer is None:
                    buffer = torch.empty(_BLOCK_BYTES, dtype=torch.uint8)
                _read_sink(file, sink, meta["crc32"], buffer)
                continue
            data = _as_bytes(tensor)
            with file.open("rb") as handle:
                for offset in range(0, len(data), _BLOCK_BYTES):
                    handle.readinto(data[offset : offset + _BLOCK_BYTES])
            crcs = _crcs(data, pool)
            for block, (got, want) in enumerate(zip(crcs, meta["crc32"], strict=True)):
                if got != want:
                    raise CheckpointCorrupt(
                        f"{file} fails its checksum in block {block} (bytes {block * _BLOCK_BYTES}+); "
                        "the checkpoint is corrupt"
                    )
    return state
