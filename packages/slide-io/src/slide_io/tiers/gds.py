"""GPUDirect Storage as a tier: CUDA tensors go between GPU memory and files through kvikio (cuFile).

With GDS the NVMe DMA engine writes into GPU memory directly, skipping the host bounce copy and the CPU.
The tier keeps the NVMe tier's file layout and bookkeeping (one file per key version, index switched only
after a complete write) and only swaps the data path for CUDA tensors; host tensors still take the POSIX
path. ``mode`` says what actually moves the bytes:

- ``"gds"``: kvikio drives cuFile (it may still fall back per file if the filesystem is not GDS-capable);
- ``"compat"``: kvikio is installed but uses POSIX I/O itself (no libcufile, no /run/udev, ...);
- ``"posix-fallback"``: kvikio is not importable; everything goes through ``PosixNvmeTier``'s path.

For CUDA tensors kvikio's own thread pool moves the bytes in tasks of ``chunk_bytes`` (its ``task_size``);
the size of that pool is kvikio's process-wide setting (``KVIKIO_NTHREADS``, default 1), not
``io_threads``, which only drives the POSIX path. ``bench/io.py --sweep`` sets the pool size per row.

The caller must have finished producing a CUDA tensor (synchronise its stream) before ``put``, and must not
use ``out`` before ``get``'s future is done: cuFile does not order itself after torch streams.
"""

from __future__ import annotations

import errno
import logging
import os
from types import ModuleType

import torch

from slide_io._bytes import as_bytes
from slide_io._kvikio import kvikio_mode, load_kvikio
from slide_io.tiers.posix_nvme import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_IO_THREADS,
    Allocator,
    PosixNvmeTier,
    _Entry,
    _Plan,
)

__all__ = ["GdsTier"]

logger = logging.getLogger(__name__)

_SPACE_WORDS = (("No space left", errno.ENOSPC), ("File too large", errno.EFBIG), ("quota", errno.EDQUOT))


class GdsTier(PosixNvmeTier):
    """Keys stored as files under ``directory``; CUDA tensors move through kvikio when it is available."""

    name = "gds"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        io_threads: int = DEFAULT_IO_THREADS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        direct: bool | None = None,
        alloc: Allocator | None = None,
    ) -> None:
        super().__init__(directory, io_threads=io_threads, chunk_bytes=chunk_bytes, direct=direct, alloc=alloc)
        kvikio, detail = load_kvikio()
        self._kvikio: ModuleType | None = kvikio
        if kvikio is None:
            self.mode = "posix-fallback"
            logger.warning(
                "gds tier on %s: kvikio is not importable (%s); using POSIX I/O through host bounce buffers",
                self.directory,
                detail,
            )
        else:
            self.mode = kvikio_mode(kvikio)

    def _write_plan(self, entry: _Entry, src: torch.Tensor) -> _Plan:
        if self._kvikio is None or src.device.type != "cuda":
            return super()._write_plan(entry, src)
        handle = self._kvikio.CuFile(entry.path, "w")

        def write() -> None:
            written = handle.write(src, task_size=self.chunk_bytes)
            if written != entry.nbytes:
                raise OSError(errno.ENOSPC, f"short write: {written} of {entry.nbytes} bytes")

        return _Plan(tasks=[write] if entry.nbytes else [], release=handle.close)

    def _read_plan(self, entry: _Entry, out: torch.Tensor) -> _Plan:
        if self._kvikio is None or out.device.type != "cuda" or not out.is_contiguous():
            return super()._read_plan(entry, out)
        handle = self._kvikio.CuFile(entry.path, "r")
        dst = as_bytes(out)

        def read() -> None:
            got = handle.read(dst, task_size=self.chunk_bytes)
            if got != entry.nbytes:
                raise OSError(errno.EIO, f"short read: {got} of {entry.nbytes} bytes")

        return _Plan(tasks=[read] if entry.nbytes else [], release=handle.close, result=lambda: out)

    def _io_error(self, verb: str, key: str, entry: _Entry, error: BaseException) -> BaseException:
        # kvikio reports errno failures as RuntimeError text; recover the errno so a full disk reads the same.
        if not isinstance(error, OSError):
            for words, code in _SPACE_WORDS:
                if words in str(error):
                    translated = OSError(code, os.strerror(code))
                    translated.__cause__ = error
                    error = translated
                    break
        return super()._io_error(verb, key, entry, error)
