"""Giving host pages back to the operating system without freeing the tensor that spans them.

A device-resident unit's fp32 master lives on the GPU during training; its range of the host slab is
only read after the engine copies the master back (drain, checkpoint, export). Releasing the range's
pages in between (``madvise(MADV_DONTNEED)``) takes 4 bytes per resident parameter off the host's
resident set; the pages come back, zero-filled, the next time the range is written.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

__all__ = ["release_pages"]

_MADV_DONTNEED = 4  # Linux


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def release_pages(tensor: torch.Tensor) -> int:
    """Release the whole pages inside ``tensor`` (a contiguous host tensor); return the bytes released.

    Their contents are lost: read the range only after writing it again. Pages shared with memory
    outside the tensor are kept. Returns 0 where this is not supported (not Linux) or nothing fits.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
        return 0
    libc = _libc()
    if libc is None:
        return 0
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = (start + page - 1) // page * page
    last = end // page * page
    if last <= first:
        return 0
    if libc.madvise(first, last - first, _MADV_DONTNEED) != 0:
        return 0
    return last - first
