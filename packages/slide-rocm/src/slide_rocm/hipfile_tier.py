"""EXPERIMENTAL: a tier that moves bytes between NVMe files and GPU memory with AMD hipFile.

hipFile (AMD Infinity Storage) is ROCm's counterpart to GPUDirect Storage: it DMAs file data straight into
GPU memory, falling back to POSIX I/O inside the library when the direct path is unavailable. Its Python
bindings are pre-release and their API has changed between versions, so this tier:

- refuses to construct, with a :class:`TierError` that says to use the ``nvme`` tier, when no bindings import
  or when they lack the calls used here (``Driver``, ``Buffer``, ``FileHandle.read``/``write``);
- does each ``put``/``get`` synchronously (the returned future is already done), one file per key, opened with
  ``O_DIRECT`` so the direct path can be taken, and therefore wants sizes in whole 4 KiB pages;
- has been tested only against a stand-in for the bindings on a CPU machine, never against real hipFile.

There is deliberately no fallback to POSIX here: slide-core has no POSIX tier to fall back to, and the
``nvme`` tier of slide-io is the supported path on AMD (``ROCmPolicy`` picks it by default).
"""

from __future__ import annotations

import importlib
import os
import shutil
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote

import torch

from slide_core.tier import Tier, TierError, TierRequest
from slide_rocm.hip import HIPFILE_MODULES, probe_module
from slide_rocm.transfer import format_bytes

__all__ = ["DIRECT_IO_ALIGNMENT", "HipFileTier"]

DIRECT_IO_ALIGNMENT = 4096
"""O_DIRECT transfers move whole logical blocks; 4 KiB covers the NVMe drives hipFile targets."""

_API: tuple[tuple[str, str], ...] = (("Driver", "driver"), ("Buffer", "buffer"), ("FileHandle", "file"))
"""(class, submodule it lives in) for each binding class used; the top-level module may not re-export it."""


def _resolve(module: ModuleType, name: str, submodule: str) -> Any:
    found = getattr(module, name, None)
    if found is not None:
        return found
    try:
        return getattr(importlib.import_module(f"{module.__name__}.{submodule}"), name, None)
    except ImportError:
        return None


def _done(value: Any = None, error: BaseException | None = None) -> Future[Any]:
    future: Future[Any] = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future


class HipFileTier(Tier):
    """One file per key under ``root``, read and written through hipFile. Experimental; see the module doc."""

    name = "hipfile"
    experimental = True
    on_disk = True

    @classmethod
    def for_run(cls, request: TierRequest) -> HipFileTier:
        """Its files go under ``request.directory`` (the run's folder in ``--nvme-dir``)."""
        if request.directory is None:
            raise ValueError("the hipfile tier needs a directory on a fast local disk (--nvme-dir)")
        return cls(request.directory)

    def __init__(self, root: str | os.PathLike[str], *, direct: bool = True) -> None:
        super().__init__()
        module_name = probe_module(HIPFILE_MODULES)
        if module_name is None:
            raise TierError(
                "hipfile tier needs AMD hipFile Python bindings (`hipfile`, built against libhipfile from "
                f"ROCm/TheRock; tried {', '.join(HIPFILE_MODULES)}) and none imports here; use the nvme tier"
            )
        module = importlib.import_module(module_name)
        classes = {name: _resolve(module, name, sub) for name, sub in _API}
        missing = [name for name, cls in classes.items() if cls is None]
        handle = classes["FileHandle"]
        if handle is not None:
            missing += [f"FileHandle.{op}" for op in ("read", "write") if not hasattr(handle, op)]
        if missing:
            raise TierError(
                f"hipfile tier: the installed bindings ({module_name}) lack {', '.join(missing)}; their API "
                "is pre-release and has changed. Use the nvme tier"
            )
        self._driver_cls, self._buffer_cls, self._file_cls = (classes[name] for name, _ in _API)
        binding_error = _resolve(module, "HipFileException", "error")
        self._io_errors: tuple[type[BaseException], ...] = (OSError, RuntimeError) + (
            (binding_error,) if isinstance(binding_error, type) and issubclass(binding_error, Exception) else ()
        )
        self.module_name = module_name
        self.root = Path(root)
        self.direct = direct
        self._driver: Any = None
        self._files: dict[str, tuple[Path, int, torch.dtype]] = {}

    # -- lifecycle -------------------------------------------------------------------------------------
    def _open_resources(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        driver = self._driver_cls()
        driver.open()
        self._driver = driver

    def _close_resources(self) -> None:
        # Files are scratch space owned by this tier: they go when the tier closes.
        for path, _, _ in self._files.values():
            path.unlink(missing_ok=True)
        self._files.clear()
        driver, self._driver = self._driver, None
        if driver is not None:
            driver.close()

    # -- I/O -------------------------------------------------------------------------------------------
    def _flags(self, *extra: int) -> int:
        flags = os.O_RDWR
        for flag in extra:
            flags |= flag
        if self.direct:
            flags |= getattr(os, "O_DIRECT", 0)
        return flags

    def _check(self, key: str, tensor: torch.Tensor) -> int:
        if self._driver is None:
            raise TierError("hipfile tier is closed; use it inside `with tier:`")
        if not tensor.is_contiguous():
            raise TierError(f"hipfile tier key {key!r}: tensor must be contiguous (hipFile DMAs one range)")
        nbytes = tensor.numel() * tensor.element_size()
        if self.direct and nbytes % DIRECT_IO_ALIGNMENT:
            raise TierError(
                f"hipfile tier key {key!r}: {format_bytes(nbytes)} ({nbytes} bytes) is not a multiple of "
                f"{DIRECT_IO_ALIGNMENT} bytes, which O_DIRECT needs; pad the tensor or use the nvme tier"
            )
        return nbytes

    def _transfer(self, op: str, path: Path, flags: int, tensor: torch.Tensor, nbytes: int) -> None:
        try:
            with (
                self._buffer_cls(tensor.data_ptr(), nbytes, 0) as buffer,
                self._file_cls(path, flags) as handle,
            ):
                moved = getattr(handle, op)(buffer, nbytes, 0, 0)
        except self._io_errors as error:
            raise TierError(f"hipfile tier {op} of {format_bytes(nbytes)} at {path} failed: {error}") from error
        if moved != nbytes:
            raise TierError(f"hipfile tier {op} at {path} moved {moved} of {nbytes} bytes")

    def put(self, key: str, tensor: torch.Tensor) -> Future[None]:
        nbytes = self._check(key, tensor)
        path = self.root / f"{quote(key, safe='')}.bin"
        try:
            self._transfer("write", path, self._flags(os.O_CREAT, os.O_TRUNC), tensor, nbytes)
        except TierError as error:
            return _done(error=error)
        self._files[key] = (path, tensor.numel(), tensor.dtype)
        return _done()

    def get(self, key: str, out: torch.Tensor) -> Future[torch.Tensor]:
        nbytes = self._check(key, out)
        held = self._files.get(key)
        if held is None:
            raise TierError(f"hipfile tier has no key {key!r}")
        path, numel, dtype = held
        if numel != out.numel() or dtype != out.dtype:
            raise TierError(f"hipfile tier key {key!r} holds {numel} x {dtype}, asked for {out.numel()} x {out.dtype}")
        try:
            self._transfer("read", path, self._flags(), out, nbytes)
        except TierError as error:
            return _done(error=error)
        return _done(out)

    def delete(self, key: str) -> None:
        held = self._files.pop(key, None)
        if held is not None:
            held[0].unlink(missing_ok=True)

    def capacity_bytes(self) -> int | None:
        return shutil.disk_usage(self.root if self.root.exists() else self.root.parent).free
