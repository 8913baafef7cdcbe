"""Writers of the two checkpoint layouts that came before the manifest format, byte for byte as the code
of that time wrote them (checked against it when this file was written), so tests can prove those
checkpoints still resume without committing binary fixtures.

- :func:`write_single`: format 2, one process. ``state.json`` (``files``: per ``<name>.bin`` its bytes,
  dtype, numel and 256 MiB-block CRC32s; ``extra``; a SHA-256 ``checksum``) beside one raw file per array.
- :func:`write_data_parallel`: N ranks. The step directory is a format-2 checkpoint with no arrays whose
  ``extra`` adds ``world_size`` and ``ranks``; ``rank-K/`` is rank K's single checkpoint of its shards:
  ``shard_span(n, K, N)`` of every unit of ``n`` elements, concatenated in slab order.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from slide_core.distributed import shard_span

BLOCK_BYTES = 256 * 2**20


def _checksum(state: Mapping[str, Any]) -> str:
    body = {key: value for key, value in state.items() if key != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


def write_single(directory: Path, step: int, arrays: Mapping[str, torch.Tensor], extra: Mapping[str, Any]) -> Path:
    """``directory`` (created) as a format-2 single-process checkpoint of host ``arrays``."""
    directory.mkdir(parents=True)
    files: dict[str, Any] = {}
    for name, tensor in arrays.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        (directory / f"{name}.bin").write_bytes(data)
        crcs = [zlib.crc32(data[offset : offset + BLOCK_BYTES]) for offset in range(0, len(data), BLOCK_BYTES)]
        dtype = str(tensor.dtype).removeprefix("torch.")
        files[f"{name}.bin"] = {"bytes": len(data), "dtype": dtype, "numel": tensor.numel(), "crc32": crcs}
    state: dict[str, Any] = {"format": 2, "step": step, "files": files, "extra": dict(extra)}
    state = json.loads(json.dumps(state))
    state["checksum"] = _checksum(state)
    (directory / "state.json").write_text(json.dumps(state, indent=1), encoding="utf-8")
    return directory


def shards_of(whole: torch.Tensor, unit_numels: Sequence[int], rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank`` of ``world_size``'s shards of every unit of ``whole``, in slab order."""
    parts, start = [], 0
    for numel in unit_numels:
        lo, hi = shard_span(numel, rank, world_size)
        parts.append(whole[start + lo : start + hi])
        start += numel
    return torch.cat(parts)


def write_data_parallel(
    directory: Path,
    step: int,
    arrays: Mapping[str, torch.Tensor],
    extra: Mapping[str, Any],
    unit_numels: Sequence[int],
    world_size: int,
) -> Path:
    """``directory`` as the step directory ``world_size`` ranks wrote of whole ``arrays`` (every unit in
    slab order): the manifest and each rank's folder of its shards."""
    ranks = [f"rank-{rank}" for rank in range(world_size)]
    write_single(directory, step, {}, {**extra, "world_size": world_size, "ranks": ranks})
    for rank, folder in enumerate(ranks):
        shards = {name: shards_of(whole, unit_numels, rank, world_size) for name, whole in arrays.items()}
        write_single(directory / folder, step, shards, extra)
    return directory
