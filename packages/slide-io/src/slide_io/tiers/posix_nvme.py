"""NVMe (any local filesystem) as a tier: one file per stored key version, moved by a pool of I/O threads.

Layout: ``open`` creates a private directory ``slide-nvme-XXXXXXXX`` under the directory it is given, and
every ``put`` writes a brand-new file ``<uuid>.slab`` in it. Only when every byte of that file is written
does the key's index entry switch to it (and the previous file get unlinked), so a failed write - disk full,
file size limit, an I/O error - leaves the previous version of the key, and every other key, readable. One
file per version also gives the space of deleted keys straight back to the filesystem, so
``capacity_bytes`` (from ``statvfs``) stays honest. ``close`` removes the private directory.

I/O: O_DIRECT when the filesystem accepts it (probed at ``open``; reported as ``direct_io``), so
offloaded weights and optimizer state do not evict the page cache or get copied twice. O_DIRECT needs
4 KiB aligned addresses, offsets and lengths: each request is cut into ``chunk_bytes`` chunks that run on
``io_threads`` threads, and the last chunk of a key is zero-padded on disk to a 4 KiB multiple while the
index records the true length. Host memory on a 4 KiB boundary is read and written in place (a write
still stages a key's last chunk when its length is not a 4 KiB multiple); anything else is staged through
a 4 KiB aligned bounce buffer (one per thread, allocated at ``open``). Reads into an aligned destination
copy at most the last 4095 bytes of a key (see Note [Direct reads]). Without
O_DIRECT, host tensors are written and read in place, with no bounce copy. ``os.pwrite``, ``os.preadv``,
``ctypes.memmove`` and torch copies release the GIL, so the threads overlap.

Note [Direct reads]: a chunk of a host destination whose address is on a 4 KiB boundary is read with one
``preadv`` straight into the destination. If the chunk's length is not a 4 KiB multiple (only the last
chunk of a key), the same ``preadv`` gets a second iovec, the first 4 KiB of the thread's bounce buffer,
for the padded final block, and only those < 4096 bytes are copied. A destination that is not on a 4 KiB
boundary cannot be read in place at all: file offset ``o`` lands at address ``out + o``, so no aligned file
block meets an aligned address. Such a chunk is read whole into the bounce buffer and copied with one
``memmove`` (torch's ``copy_`` may fan out to its intra-op thread pool from every I/O thread at once).
Allocate destinations on 4 KiB boundaries (``slide_io._bytes.aligned_empty``, or page-locked memory,
whose blocks start on pages) to get the direct path. ``tests/io/test_posix_nvme.py`` checks each case.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import itertools
import os
import queue
import resource
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slide_core.tier import Tier, TierError, TierRequest
from slide_io._bytes import DIRECT_ALIGN, aligned_empty, as_bytes, round_up
from slide_io._futures import failed, gather

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_IO_THREADS", "PosixNvmeTier"]

DEFAULT_IO_THREADS = 4
"""I/O threads per tier when the caller gives none (``GdsTier`` and ``bench/io_bench.py`` share it).

Set it to the io-threads of the row ``python bench/io_bench.py --sweep`` marks "best get" on the target disk:
reads sit on the critical path of the forward pass, writes overlap compute."""

DEFAULT_CHUNK_BYTES = 8 << 20
"""Bytes per I/O request and per bounce buffer when the caller gives none; a multiple of 4 KiB.

Set it from the same ``bench/io_bench.py --sweep`` row as ``DEFAULT_IO_THREADS`` (its chunk MiB << 20)."""

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
_NO_DIRECT_ERRNOS = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})

Allocator = Callable[[int, torch.dtype], torch.Tensor]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``.

    A short write means the device or the file size limit ran out; the retry then fails with ENOSPC or
    EFBIG - or, under O_DIRECT, with EINVAL because the remainder is no longer block aligned, which is
    reported as ENOSPC too. A write that makes no progress at all is ENOSPC.
    """
    written = 0
    while written < len(data):
        try:
            count = os.pwrite(fd, data[written:], offset + written)
        except OSError as error:
            if written and error.errno == errno.EINVAL:
                raise OSError(errno.ENOSPC, f"short write: {written} of {len(data)} bytes") from error
            raise
        if count <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written += count


def _pread_into(fd: int, views: list[memoryview], offset: int, need: int) -> None:
    """Fill at least ``need`` bytes of ``views``, in order, with one ``preadv`` from ``offset``.

    Under O_DIRECT the views may ask for more than ``need``: the padding of the file's last 4 KiB block.
    A short read (end of file, a signal) resumes where it stopped.
    """
    got = 0
    while got < need:
        count = os.preadv(fd, _skip(views, got) if got else views, offset + got)
        if count <= 0:
            raise OSError(errno.EIO, f"file ends {need - got} bytes early at offset {offset + got}")
        got += count


def _skip(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """``views`` without their first ``nbytes`` bytes (only after a short read, which is rare)."""
    rest = []
    for view in views:
        if nbytes >= len(view):
            nbytes -= len(view)
        else:
            rest.append(view[nbytes:])
            nbytes = 0
    return rest


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the ``uint8`` tensor ``src`` into ``dst`` of the same length.

    Host to host it is one ``memmove`` (GIL released), not torch's ``copy_``: see Note [Direct reads].
    """
    if dst.device.type == "cpu" and src.device.type == "cpu":
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel())
    else:
        dst.copy_(src)


def _host_view(tensor: torch.Tensor) -> memoryview:
    """A memoryview over a host ``uint8`` tensor's bytes (no copy), for the buffer-protocol syscalls."""
    # numpy declares ndarray's buffer protocol (``__buffer__``) to the type checker only from Python 3.12 on.
    return memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Entry:
    """One stored key version: its file, its true length and what it decodes to."""

    path: Path
    nbytes: int
    numel: int
    dtype: torch.dtype
    seq: int


@dataclass
class _Plan:
    """The work for one request: ``tasks`` run on the I/O threads; ``release`` runs once afterwards
    (success or failure) to close handles; ``result`` produces the future's value on success."""

    tasks: list[Callable[[], None]]
    release: Callable[[], None]
    result: Callable[[], Any] = field(default=lambda: None)


class PosixNvmeTier(Tier):
    """Keys stored as files under ``directory``, read and written by ``io_threads`` threads.

    ``direct``: None probes O_DIRECT and uses it if the filesystem accepts it; True requires it (open fails
    otherwise); False never uses it. ``chunk_bytes`` (a multiple of 4 KiB) is the unit of work per thread
    and the size of each thread's bounce buffer; ``io_threads`` requests run at once. Their defaults,
    ``DEFAULT_IO_THREADS`` and ``DEFAULT_CHUNK_BYTES``, come from ``bench/io_bench.py --sweep``.
    ``alloc(numel, torch.uint8)`` allocates the bounce buffers: pass ``device.alloc_pinned`` so CUDA
    tensors are staged through page-locked memory.

    Host tensors on a 4 KiB boundary move without a copy (Note [Direct reads]); others, and CUDA tensors,
    go through the bounce buffers.

    CUDA tensors are accepted: chunks are copied through the bounce buffers on the I/O threads' current
    (default) stream, so the caller must have synchronised the stream that produced a tensor before
    ``put``, and must not read ``out`` before ``get``'s future is done.
    """

    name = "nvme"
    on_disk = True

    @classmethod
    def for_run(cls, request: TierRequest) -> PosixNvmeTier:
        """Its files go under ``request.directory`` (the run's folder in ``--nvme-dir``)."""
        if request.directory is None:
            raise ValueError(f"the {cls.name} tier needs a directory on a fast local disk (--nvme-dir)")
        return cls(request.directory)

    @classmethod
    def host_bytes_for(cls, request: TierRequest) -> int:
        """The bounce buffers :meth:`for_run`'s tier allocates at ``open``: one per I/O thread, each over-
        allocated by one alignment unit (``aligned_empty``). Touched at ``open``, so always resident."""
        return DEFAULT_IO_THREADS * (DEFAULT_CHUNK_BYTES + DIRECT_ALIGN)

    def host_bytes(self) -> int:
        """The bounce buffers, whole (allocated at ``open``; nothing while closed)."""
        return sum(buffer.untyped_storage().nbytes() for buffer in self._bounce_buffers)

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        io_threads: int = DEFAULT_IO_THREADS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        direct: bool | None = None,
        alloc: Allocator | None = None,
    ) -> None:
        super().__init__()
        if io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {io_threads}")
        if chunk_bytes < DIRECT_ALIGN or chunk_bytes % DIRECT_ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {DIRECT_ALIGN}, got {chunk_bytes}")
        self.directory = Path(directory)
        self.io_threads = io_threads
        self.chunk_bytes = chunk_bytes
        self._direct_request = direct
        self._alloc = alloc
        self.direct_io = False  # whether files are opened with O_DIRECT; known after ``open``
        self._lock = threading.Lock()
        self._root: Path | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._bounce: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._bounce_buffers: list[torch.Tensor] = []  # every bounce buffer, for host_bytes
        self._entries: dict[str, _Entry] = {}
        self._seq = itertools.count(1)
        self._issued = 0  # seq of the latest put issued
        self._inflight: dict[str, int] = {}  # key -> puts not yet installed or abandoned
        self._floor: dict[str, int] = {}  # key -> puts at or below this seq were overtaken by a delete

    # -- lifecycle -------------------------------------------------------------------------------------
    def _open_resources(self) -> None:
        if not self.directory.exists():
            raise TierError(f"{self.name} tier: directory {self.directory} does not exist")
        if not self.directory.is_dir():
            raise TierError(f"{self.name} tier: {self.directory} is not a directory")
        try:
            root = Path(tempfile.mkdtemp(prefix="slide-nvme-", dir=self.directory))
        except OSError as error:
            raise TierError(
                f"{self.name} tier: cannot create files in {self.directory}: {error.strerror or error}"
            ) from error
        try:
            self.direct_io = self._choose_direct(root)
            # One bounce buffer per thread: a running chunk never waits for a buffer. Touched now, so the
            # first requests do not pay their page faults.
            buffers = [aligned_empty(self.chunk_bytes, alloc=self._alloc).zero_() for _ in range(self.io_threads)]
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        self._root = root
        self._entries = {}
        self._inflight = {}
        self._floor = {}
        self._bounce = queue.SimpleQueue()
        self._bounce_buffers = buffers
        for buffer in buffers:
            self._bounce.put(buffer)
        self._executor = ThreadPoolExecutor(self.io_threads, thread_name_prefix=f"slide-{self.name}-io")

    def _close_resources(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)  # drains in-flight requests; their futures settle first
        with self._lock:
            root, self._root = self._root, None
            self._entries = {}
            self._inflight = {}
            self._floor = {}
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
        self._bounce = queue.SimpleQueue()
        self._bounce_buffers = []

    def _choose_direct(self, root: Path) -> bool:
        supported = self._direct_request is not False and _O_DIRECT != 0 and self._probe_direct(root)
        if self._direct_request and not supported:
            raise TierError(f"{self.name} tier: O_DIRECT was required but {self.directory} does not support it")
        return supported

    def _probe_direct(self, root: Path) -> bool:
        """Whether an aligned O_DIRECT write works here (tmpfs and some FUSE filesystems refuse it)."""
        probe = root / ".direct-probe"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | _O_DIRECT, 0o600)
        except OSError as error:
            if error.errno in _NO_DIRECT_ERRNOS:
                return False
            raise TierError(f"{self.name} tier: cannot create files in {self.directory}: {error}") from error
        try:
            block = aligned_empty(DIRECT_ALIGN)
            block.fill_(0x5A)
            _pwrite_all(fd, _host_view(block), 0)
        except OSError as error:
            if error.errno in _NO_DIRECT_ERRNOS:
                return False
            raise TierError(f"{self.name} tier: cannot write files in {self.directory}: {error}") from error
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
        return True

    # -- Tier API --------------------------------------------------------------------------------------
    def put(self, key: str, tensor: torch.Tensor) -> Future[None]:
        src = as_bytes(tensor)
        with self._lock:
            root = self._require_open(key)
            seq = next(self._seq)
            self._issued = seq
            self._inflight[key] = self._inflight.get(key, 0) + 1
        entry = _Entry(
            path=root / f"{uuid.uuid4().hex}.slab",
            nbytes=src.numel(),
            numel=tensor.numel(),
            dtype=tensor.dtype,
            seq=seq,
        )
        try:
            plan = self._write_plan(entry, src)
        except Exception as error:  # opening the file failed: report it through the future like I/O errors
            return failed(self._abandon(key, entry, error))
        return self._run(plan, finish=lambda: self._install(key, entry), fail=lambda e: self._abandon(key, entry, e))

    def get(self, key: str, out: torch.Tensor) -> Future[torch.Tensor]:
        with self._lock:
            self._require_open(key)
            entry = self._entries.get(key)
            if entry is None:
                raise TierError(f"{self.name} tier has no key {key!r}")
            if entry.numel != out.numel() or entry.dtype != out.dtype:
                raise TierError(
                    f"{self.name} tier key {key!r} holds {entry.numel} x {entry.dtype}, "
                    f"asked for {out.numel()} x {out.dtype}"
                )
            # Open while the index still points at the file: a concurrent delete or overwrite may unlink
            # it, but an open descriptor keeps reading this version.
            try:
                plan = self._read_plan(entry, out)
            except Exception as error:
                return failed(self._io_error("reading", key, entry, error))
        return self._run(plan, finish=lambda: None, fail=lambda e: self._io_error("reading", key, entry, e))

    def delete(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if self._inflight.get(key):
                self._floor[key] = self._issued  # puts issued before this delete must not resurrect the key
        if entry is not None:
            entry.path.unlink(missing_ok=True)

    def capacity_bytes(self) -> int | None:
        """Bytes the filesystem still lets an unprivileged writer use (``statvfs`` ``f_bavail``)."""
        target = self._root if self._root is not None else self.directory
        try:
            stat = os.statvfs(target)
        except OSError:
            return None
        return stat.f_bavail * stat.f_frsize

    def stored_keys(self) -> list[str]:
        """The keys currently stored, sorted."""
        with self._lock:
            return sorted(self._entries)

    # -- plans (GdsTier overrides these for CUDA tensors) ---------------------------------------------
    def _write_plan(self, entry: _Entry, src: torch.Tensor) -> _Plan:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (_O_DIRECT if self.direct_io else 0)
        fd = os.open(entry.path, flags, 0o600)
        tasks: list[Callable[[], None]] = [
            functools.partial(self._write_chunk, fd, src, start, min(start + self.chunk_bytes, entry.nbytes))
            for start in range(0, entry.nbytes, self.chunk_bytes)
        ]
        return _Plan(tasks=tasks, release=lambda: os.close(fd))

    def _read_plan(self, entry: _Entry, out: torch.Tensor) -> _Plan:
        fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if self.direct_io else 0))
        # Read straight into ``out`` when it is contiguous; otherwise into a flat, aligned (so read in place)
        # buffer copied at the end: the one per-request allocation, and only for strided outputs.
        dst = as_bytes(out) if out.is_contiguous() else aligned_empty(entry.nbytes)

        def result() -> torch.Tensor:
            if not out.is_contiguous():
                out.copy_(dst.view(entry.dtype).view(out.shape))
            return out

        tasks: list[Callable[[], None]] = [
            functools.partial(self._read_chunk, fd, dst, start, min(start + self.chunk_bytes, entry.nbytes))
            for start in range(0, entry.nbytes, self.chunk_bytes)
        ]
        return _Plan(tasks=tasks, release=lambda: os.close(fd), result=result)

    def _write_chunk(self, fd: int, src: torch.Tensor, start: int, stop: int) -> None:
        piece = src[start:stop]
        if self._in_place_ok(piece):
            _pwrite_all(fd, _host_view(piece), start)
            return
        bounce = self._bounce.get()
        try:
            count = stop - start
            padded = round_up(count, DIRECT_ALIGN) if self.direct_io else count
            bounce[:count].copy_(piece)
            bounce[count:padded].zero_()  # padding up to the 4 KiB block: never write stale bytes
            _pwrite_all(fd, _host_view(bounce[:padded]), start)
        finally:
            self._bounce.put(bounce)

    def _read_chunk(self, fd: int, dst: torch.Tensor, start: int, stop: int) -> None:
        """Read ``[start, stop)`` of the file into ``dst[start:stop]``; see Note [Direct reads]."""
        piece = dst[start:stop]
        count = stop - start
        if piece.device.type == "cpu" and (not self.direct_io or piece.data_ptr() % DIRECT_ALIGN == 0):
            body = count - count % DIRECT_ALIGN if self.direct_io else count
            if body == count:
                _pread_into(fd, [_host_view(piece)], start, count)
                return
            bounce = self._bounce.get()
            try:
                block = bounce[:DIRECT_ALIGN]  # the key's padded last block
                views = [_host_view(piece[:body]), _host_view(block)] if body else [_host_view(block)]
                _pread_into(fd, views, start, count)
                _copy_bytes(piece[body:], block[: count - body])
            finally:
                self._bounce.put(bounce)
            return
        bounce = self._bounce.get()
        try:
            padded = round_up(count, DIRECT_ALIGN) if self.direct_io else count
            _pread_into(fd, [_host_view(bounce[:padded])], start, count)
            _copy_bytes(piece, bounce[:count])
        finally:
            self._bounce.put(bounce)

    def _in_place_ok(self, piece: torch.Tensor) -> bool:
        """Host memory can go to the syscall as is, unless O_DIRECT wants alignment it does not have."""
        if piece.device.type != "cpu":
            return False
        if not self.direct_io:
            return True
        return piece.data_ptr() % DIRECT_ALIGN == 0 and piece.numel() % DIRECT_ALIGN == 0

    # -- bookkeeping -----------------------------------------------------------------------------------
    def _require_open(self, key: str) -> Path:
        """The private directory; raises if the tier is closed. Caller holds ``self._lock``."""
        if self._root is None or self._executor is None:
            raise TierError(f"{self.name} tier is closed (key {key!r})")
        return self._root

    def _run(
        self,
        plan: _Plan,
        finish: Callable[[], None],
        fail: Callable[[BaseException], BaseException],
    ) -> Future[Any]:
        """Submit ``plan.tasks``; the returned future settles once all of them did and ``release`` ran."""
        executor = self._executor
        released = threading.Lock()

        def release() -> None:
            if released.acquire(blocking=False):
                plan.release()

        def on_success() -> Any:
            release()
            finish()
            return plan.result()

        def on_failure(error: BaseException) -> BaseException:
            with contextlib.suppress(OSError):
                release()
            return fail(error)

        try:
            if executor is None:
                raise RuntimeError(f"{self.name} tier was closed while a request was being issued")
            parts = [executor.submit(task) for task in plan.tasks]
        except RuntimeError as error:  # the executor shut down between the open check and submit
            return failed(on_failure(error))
        return gather(parts, finish=on_success, fail=on_failure)

    def _install(self, key: str, entry: _Entry) -> None:
        """Point ``key`` at a fully written file, unless a newer put or a delete overtook this one."""
        with self._lock:
            current = self._entries.get(key)
            newest = current is None or current.seq < entry.seq
            if newest and entry.seq > self._floor.get(key, 0) and self._root is not None:
                self._entries[key] = entry
                stale = current
            else:
                stale = entry
            self._settle_inflight(key)
        if stale is not None:
            stale.path.unlink(missing_ok=True)

    def _abandon(self, key: str, entry: _Entry, error: BaseException) -> BaseException:
        """Drop a failed write's file (the key keeps its previous version) and describe the failure."""
        entry.path.unlink(missing_ok=True)
        with self._lock:
            self._settle_inflight(key)
        return self._io_error("writing", key, entry, error)

    def _settle_inflight(self, key: str) -> None:
        left = self._inflight.get(key, 0) - 1
        if left > 0:
            self._inflight[key] = left
        else:
            self._inflight.pop(key, None)
            self._floor.pop(key, None)

    def _io_error(self, verb: str, key: str, entry: _Entry, error: BaseException) -> BaseException:
        """A one-line TierError naming the path and, for a full disk, the bytes needed and free."""
        if isinstance(error, TierError):
            return error
        path = entry.path
        if isinstance(error, OSError) and error.errno in _SPACE_ERRNOS:
            needed = round_up(entry.nbytes, DIRECT_ALIGN) if self.direct_io else entry.nbytes
            free = self.capacity_bytes()
            message = (
                f"{self.name} tier: no space writing {key!r} to {path}: needs {needed} bytes, "
                f"{free if free is not None else 'unknown'} bytes free ({os.strerror(error.errno)})"
            )
            if error.errno == errno.EFBIG:
                limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
                if limit != resource.RLIM_INFINITY:
                    message += f"; the file size limit (RLIMIT_FSIZE) is {limit} bytes"
        else:
            detail = error.strerror if isinstance(error, OSError) and error.strerror else repr(error)
            message = f"{self.name} tier: {verb} {key!r} ({entry.nbytes} bytes) at {path} failed: {detail}"
        wrapped = TierError(message)
        wrapped.__cause__ = error
        return wrapped
