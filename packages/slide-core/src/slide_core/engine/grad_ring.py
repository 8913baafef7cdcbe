"""Pinned host chunks that carry gradients from the device to the optimizer thread.

A fixed ring bounds the host memory gradients use in flight (``slots x chunk`` elements, whatever the
model size) and gives back-pressure: the transfer thread waits for a free chunk, never allocates one.
"""

from __future__ import annotations

import queue

import torch

from slide_core.device import Device

__all__ = ["GradRing"]


class GradRing:
    def __init__(self, device: Device, slots: int, chunk_numel: int, dtype: torch.dtype) -> None:
        self.chunk_numel = chunk_numel
        self._slab = device.alloc_pinned(slots * chunk_numel, dtype)
        self.chunks = [self._slab[i * chunk_numel : (i + 1) * chunk_numel] for i in range(slots)]
        self.free: queue.Queue[int] = queue.Queue()
        for index in range(slots):
            self.free.put(index)

    def release(self, index: int) -> None:
        self.free.put(index)

    @property
    def nbytes(self) -> int:
        return self._slab.numel() * self._slab.element_size()
