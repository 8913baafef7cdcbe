"""Boundary activations: each block's input slides out to pinned host memory in the forward pass and
comes back, one block ahead, in the backward pass.

Note [Activation buffer reuse]: the backward pass alternates between two device buffers. A copy into a
buffer waits (stream-side) for the compute that last read it; compute waits for the copy's event.
"""

from __future__ import annotations

import torch

from slide_core.device import Device, Event

__all__ = ["ActivationStash"]


class ActivationStash:
    def __init__(self, device: Device, num_blocks: int) -> None:
        self.device = device
        self.num_blocks = num_blocks
        self._shape: tuple[int, ...] | None = None
        self._dtype: torch.dtype | None = None
        self._host: list[torch.Tensor] = []
        self._device_buffers: list[torch.Tensor] = []
        self._saved: dict[int, Event] = {}
        self._loaded: dict[int, tuple[int, Event]] = {}
        self._buffer_free: list[Event | None] = [None, None]

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._host)

    def ensure(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Allocate (once per shape) the host slab and the two device buffers."""
        if self._shape == shape and self._dtype == dtype:
            return
        numel = 1
        for dim in shape:
            numel *= dim
        slab = self.device.alloc_pinned(numel * self.num_blocks, dtype)
        self._host = [slab[i * numel : (i + 1) * numel].view(shape) for i in range(self.num_blocks)]
        self._device_buffers = [self.device.empty(numel, dtype).view(shape) for _ in range(2)]
        self._shape, self._dtype = shape, dtype

    def save(self, index: int, x: torch.Tensor, computed: Event) -> None:
        """Start the device-to-host copy of block ``index``'s input once ``computed`` has happened."""
        device = self.device
        with device.stream("d2h"):
            device.wait_event("d2h", computed)
            self._host[index].copy_(x, non_blocking=True)
            device.keep_alive(x, "d2h")
            self._saved[index] = device.record_event("d2h")

    def prefetch(self, index: int) -> None:
        """Start the host-to-device copy of block ``index``'s input into the next free buffer."""
        if index in self._loaded or index < 0:
            return
        buffer = index % 2
        device = self.device
        with device.stream("h2d"):
            device.wait_event("h2d", self._saved[index])
            free = self._buffer_free[buffer]
            if free is not None:
                device.wait_event("h2d", free)
            self._device_buffers[buffer].copy_(self._host[index], non_blocking=True)
            self._loaded[index] = (buffer, device.record_event("h2d"))

    def load(self, index: int) -> torch.Tensor:
        """The input of block ``index`` on the device; compute waits (stream-side) for its copy."""
        self.prefetch(index)
        buffer, event = self._loaded.pop(index)
        self.device.wait_event("compute", event)
        return self._device_buffers[buffer]

    def release(self, index: int, consumed: Event) -> None:
        """The compute that read block ``index``'s input has been issued; ``consumed`` marks its end."""
        self._buffer_free[index % 2] = consumed
