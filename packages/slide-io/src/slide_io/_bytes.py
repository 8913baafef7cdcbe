"""Byte-level helpers shared by the tiers: alignment arithmetic, aligned buffers, flat byte views.

Every tier moves raw bytes, whatever the dtype: ``bfloat16`` and ``bool`` have no numpy equivalent and
O_DIRECT wants byte-exact lengths, so tensors are reinterpreted as ``uint8`` before any copy or syscall.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["DIRECT_ALIGN", "aligned_empty", "as_bytes", "round_up", "tensor_nbytes", "writable_bytes"]

DIRECT_ALIGN = 4096
"""Alignment of buffer addresses, file offsets and lengths for O_DIRECT (the common logical block size)."""


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of ``tensor``'s bytes; a contiguous copy first if it is strided.

    The view shares memory with ``tensor`` whenever ``tensor`` is contiguous, so reading into the result
    fills ``tensor``. Callers that write into the view must pass a contiguous tensor (see ``writable_bytes``).
    """
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():  # reshape of a strided tensor may already copy; this covers the rest
        flat = flat.contiguous()
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.view(torch.uint8)


def writable_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view that aliases ``tensor``'s memory, for reading data into it.

    Raises ``ValueError`` for non-contiguous tensors: a copy would silently drop the data read.
    """
    if not tensor.is_contiguous():
        raise ValueError("the output tensor must be contiguous so data can be read straight into it")
    return as_bytes(tensor)


def aligned_empty(
    nbytes: int,
    alignment: int = DIRECT_ALIGN,
    alloc: Callable[[int, torch.dtype], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A host ``uint8`` tensor of ``nbytes`` whose first byte sits on an ``alignment`` boundary.

    Over-allocates by one alignment unit and slices, so it works with any allocator (``alloc(numel,
    dtype)``, default ``torch.empty``; pass ``device.alloc_pinned`` for page-locked memory); the slice
    keeps the parent storage alive.
    """
    raw = (
        alloc(nbytes + alignment, torch.uint8)
        if alloc is not None
        else torch.empty(nbytes + alignment, dtype=torch.uint8)
    )
    skip = (-raw.data_ptr()) % alignment
    return raw[skip : skip + nbytes]
