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
``io_threads``, which only drives the POSIX path. ``bench/io_bench.py --sweep`` sets the pool size per row.

Note [Compat mode takes the POSIX path]: in compat mode kvikio itself reads and writes with POSIX calls
through its own bounce buffers, so nothing is gained over this tier's POSIX path, which stages CUDA
tensors through page-locked bounce buffers (one per I/O thread, O_DIRECT, chunks in parallel). The two
differ in speed, though: on the H200 machine (virtio disk, no nvidia-fs) kvikio's compat reads reached
80% of dd and the POSIX tier's 89% (docs/benchmarks.md). So the tier uses kvikio only for real GDS,
unless ``kvikio_in_compat=True`` (``bench/io_bench.py --tiers gds-kvikio`` measures both). ``mode`` still
reports what kvikio would do.

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
from slide_io._kvikio import gds_status, kvikio_mode, load_kvikio
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
        kvikio_in_compat: bool = False,
    ) -> None:
        if alloc is None and torch.cuda.is_available():
            alloc = _pinned  # CUDA tensors on the POSIX path are staged through these buffers
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
        # See Note [Compat mode takes the POSIX path].
        self._via_kvikio = kvikio is not None and (self.mode == "gds" or kvikio_in_compat)

    @property
    def moves_device_memory(self) -> bool:  # type: ignore[override]
        """CUDA tensors go through kvikio, which stages them itself (real GDS: no staging at all)."""
        return self._via_kvikio

    @classmethod
    def doctor_facts(cls) -> dict[str, str]:
        """``slide doctor``'s line on GPUDirect Storage here (:func:`slide_io.gds_status`)."""
        return {"gds": gds_status().removeprefix("gds: ")}

    @staticmethod
    def real_gds_available() -> bool:
        """Whether kvikio is importable here and would use cuFile (not its compat mode)."""
        kvikio, _ = load_kvikio()
        return kvikio is not None and kvikio_mode(kvikio) == "gds"

    def _write_plan(self, entry: _Entry, src: torch.Tensor) -> _Plan:
        if not self._via_kvikio or src.device.type != "cuda":
            return super()._write_plan(entry, src)
        assert self._kvikio is not None
        handle = self._kvikio.CuFile(entry.path, "w")

        def write() -> None:
            written = handle.write(src, task_size=self.chunk_bytes)
            if written != entry.nbytes:
                raise OSError(errno.ENOSPC, f"short write: {written} of {entry.nbytes} bytes")

        return _Plan(tasks=[write] if entry.nbytes else [], release=handle.close)

    def _read_plan(self, entry: _Entry, out: torch.Tensor) -> _Plan:
        if not self._via_kvikio or out.device.type != "cuda" or not out.is_contiguous():
            return super()._read_plan(entry, out)
        assert self._kvikio is not None
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


def _pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory for the bounce buffers (CUDA copies from it run at full PCIe speed)."""
    return torch.empty(numel, dtype=dtype, pin_memory=True)
