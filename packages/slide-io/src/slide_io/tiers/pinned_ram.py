"""Pinned host RAM as a tier: one page-locked slab carved into ranges by a best-fit free list.

Why one slab: pinning is expensive and ``torch.empty(pin_memory=True)`` goes through the caching host
allocator, which rounds every request up to a power of two. One exact allocation made by the device
(``device.alloc_pinned``) at ``open`` pins each byte once, and every key gets a 256-byte aligned range of
it, so host<->device copies of any key run at full DMA speed.

Copies are synchronous (``put`` and ``get`` return finished futures): a copy between pinned memory and the
device is a DMA the engine already issues on its own transfer streams; the tier only does bookkeeping.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from slide_core.tier import Tier, TierError, TierRequest
from slide_io._bytes import tensor_nbytes
from slide_io._futures import done
from slide_io._ranges import RangeAllocator

__all__ = ["SLAB_ALIGN", "PinnedRamTier"]

SLAB_ALIGN = 256
"""Every range starts on a 256-byte boundary: enough for any dtype view and for vectorised DMA."""

KEY_ALIGNMENT_RESERVE = 512 * SLAB_ALIGN
"""Bytes a slab built for a run holds beyond what it will store: the alignment of a few hundred keys."""

Allocator = Callable[[int, torch.dtype], torch.Tensor]


def _plain_alloc(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


@dataclass(frozen=True)
class _Slot:
    """Where one key lives in the slab and what it holds."""

    offset: int
    span: int  # bytes reserved, a multiple of SLAB_ALIGN
    nbytes: int
    numel: int
    dtype: torch.dtype


class PinnedRamTier(Tier):
    """Keys stored in ranges of one host slab of ``capacity_bytes`` bytes.

    ``alloc(numel, torch.uint8)`` creates the slab at ``open``; the engine passes ``device.alloc_pinned``
    so the slab is page-locked. The default (``torch.empty``) gives ordinary pageable memory, which is what
    a CPU-only run wants.
    """

    name = "pinned"

    def __init__(self, capacity_bytes: int, alloc: Allocator | None = None) -> None:
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._alloc: Allocator = alloc if alloc is not None else _plain_alloc
        self._lock = threading.Lock()
        self._slab: torch.Tensor | None = None
        self._ranges = RangeAllocator(0, SLAB_ALIGN)
        self._slots: dict[str, _Slot] = {}

    @classmethod
    def for_run(cls, request: TierRequest) -> PinnedRamTier:
        """A slab of ``request.capacity_bytes`` (plus alignment for a few hundred keys), page-locked by the
        run's device when it is an accelerator."""
        if request.capacity_bytes is None:
            raise ValueError("the pinned tier needs to know how many bytes it will hold (capacity_bytes)")
        device = request.device
        alloc = device.alloc_pinned if device is not None and device.is_accelerator else None
        return cls(request.capacity_bytes + KEY_ALIGNMENT_RESERVE, alloc)

    @classmethod
    def host_bytes_for(cls, request: TierRequest) -> int:
        """The slab :meth:`for_run` allocates: the bytes the run will store and the keys' alignment."""
        return 0 if request.capacity_bytes is None else request.capacity_bytes + KEY_ALIGNMENT_RESERVE

    def host_bytes(self) -> int:
        """The slab, whole (allocated at ``open``; nothing while closed)."""
        slab = self._slab
        return 0 if slab is None else slab.untyped_storage().nbytes()

    # -- lifecycle -------------------------------------------------------------------------------------
    def _open_resources(self) -> None:
        slab = self._alloc(self._capacity, torch.uint8)
        if slab.dtype != torch.uint8 or slab.dim() != 1 or slab.numel() < self._capacity:
            raise TierError(
                f"pinned tier: allocator returned {tuple(slab.shape)} x {slab.dtype}, "
                f"expected a flat uint8 tensor of {self._capacity} bytes"
            )
        self._slab = slab[: self._capacity]
        self._ranges = RangeAllocator(self._capacity, SLAB_ALIGN)
        self._slots = {}

    def _close_resources(self) -> None:
        with self._lock:
            self._slots = {}
            self._ranges = RangeAllocator(0, SLAB_ALIGN)
            self._slab = None

    # -- Tier API --------------------------------------------------------------------------------------
    def put(self, key: str, tensor: torch.Tensor) -> Future[None]:
        with self._lock:
            slot = self._place(key, tensor_nbytes(tensor), tensor.numel(), tensor.dtype)
            view = self._typed(slot)
        # Copy outside the lock: the range is ours, and other keys can be placed meanwhile.
        view.view(tensor.shape).copy_(tensor)
        return done(None)

    def get(self, key: str, out: torch.Tensor) -> Future[torch.Tensor]:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                raise TierError(f"pinned tier has no key {key!r}")
            if slot.numel != out.numel() or slot.dtype != out.dtype:
                raise TierError(
                    f"pinned tier key {key!r} holds {slot.numel} x {slot.dtype}, asked for {out.numel()} x {out.dtype}"
                )
            view = self._typed(slot)
        out.copy_(view.view(out.shape))
        return done(out)

    def delete(self, key: str) -> None:
        with self._lock:
            slot = self._slots.pop(key, None)
            if slot is not None:
                self._ranges.free(slot.offset, slot.span)

    def capacity_bytes(self) -> int | None:
        """Free bytes in the slab (the largest single key may be smaller if the slab is fragmented)."""
        with self._lock:
            return self._ranges.free_bytes() if self._slab is not None else self._capacity

    # -- extras ----------------------------------------------------------------------------------------
    def reserve(self, key: str, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Place ``key`` and return a flat ``dtype`` view of its range, for writing into it directly.

        The engine DMAs activations straight into the view instead of staging them and calling ``put``;
        ``get(key, out)`` then reads them like any other key. The view aliases the slab: after
        ``delete(key)``, an overwrite of ``key`` with another size, or ``close`` it must not be used.
        """
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if nbytes < 0 or nbytes % itemsize:
            raise ValueError(f"nbytes={nbytes} is not a whole number of {dtype} elements ({itemsize} bytes)")
        with self._lock:
            return self._typed(self._place(key, nbytes, nbytes // itemsize, dtype))

    def used_bytes(self) -> int:
        """Bytes held by keys, alignment padding included."""
        with self._lock:
            return sum(slot.span for slot in self._slots.values())

    # -- internals (caller holds self._lock) -----------------------------------------------------------
    def _typed(self, slot: _Slot) -> torch.Tensor:
        assert self._slab is not None
        return self._slab[slot.offset : slot.offset + slot.nbytes].view(slot.dtype)

    def _place(self, key: str, nbytes: int, numel: int, dtype: torch.dtype) -> _Slot:
        if self._slab is None:
            raise TierError(f"pinned tier is closed (key {key!r})")
        span = self._ranges.span(nbytes)
        old = self._slots.get(key)
        if old is not None and old.span == span:
            offset = old.offset
        else:
            if old is not None:
                self._ranges.free(old.offset, old.span)
            found = self._ranges.alloc(span)
            if found is None:
                if old is not None:  # its bytes are untouched: give the range back, the key survives
                    self._ranges.claim(old.offset, old.span)
                raise TierError(
                    f"pinned tier full: key {key!r} needs {span} bytes but only "
                    f"{self._ranges.free_bytes()} of {self._capacity} bytes are free "
                    f"(largest free range {self._ranges.largest_free()} bytes)"
                )
            offset = found
        slot = _Slot(offset=offset, span=span, nbytes=nbytes, numel=numel, dtype=dtype)
        self._slots[key] = slot
        return slot
