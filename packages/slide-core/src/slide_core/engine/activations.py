"""Boundary activations: each block's input slides out to pinned host memory in the forward pass and
comes back, one block ahead, in the backward pass.

Note [Activation buffer reuse]: the backward pass alternates between two device buffers. A copy into a
buffer waits (stream-side) for the compute that last read it; compute waits for the copy's event.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from slide_core.allocation_ledger import AllocationLedger
from slide_core.device import Device, Event

__all__ = ["ActivationStash", "TierActivationStash"]

_DEVICE_BUFFERS = 2
"""Device buffers the backward alternates between (Note [Activation buffer reuse])."""

TIER_STAGING_COPIES = 2
"""Pinned host block inputs a :class:`TierActivationStash` stages through (Note [Activation staging
ordering]); none when its tier moves device memory itself."""


class _BlockInputBuffers:
    """The buffers both stashes share: ``host_copies`` pinned host views of one block input and two
    device buffers, allocated once per input shape. ``ledger``: the engine's, which counts the host slab
    (the stash of every block, or the staging in front of a tier: ``buffer`` names which)."""

    host_copies: int

    def __init__(self, device: Device, buffer: str, ledger: AllocationLedger | None) -> None:
        self.device = device
        self._buffer = buffer
        self._ledger = ledger or AllocationLedger()
        self._shape: tuple[int, ...] | None = None
        self._dtype: torch.dtype | None = None
        self._host: list[torch.Tensor] = []
        self._device_buffers: list[torch.Tensor] = []
        self._buffer_free: list[Event | None] = [None, None]

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._host)

    @staticmethod
    def device_bytes_for(input_numel: int, dtype_bytes: int) -> int:
        """Device bytes of the two buffers the backward alternates between (Note [Activation buffer
        reuse]), for block inputs of ``input_numel`` elements."""
        return _DEVICE_BUFFERS * input_numel * dtype_bytes

    @staticmethod
    def host_bytes_for(host_copies: int, input_numel: int, dtype_bytes: int) -> int:
        """Pinned host bytes of ``host_copies`` block inputs of ``input_numel`` elements: every block's
        for :class:`ActivationStash` (``num_blocks``), two staging ones for a :class:`TierActivationStash`
        that does not move device memory itself, none for one that does."""
        return host_copies * input_numel * dtype_bytes

    def ensure(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Allocate (once per shape) the pinned host slab and the two device buffers."""
        if self._shape == shape and self._dtype == dtype:
            return
        numel = math.prod(shape)
        self._host = []
        if self.host_copies:
            slab = self._ledger.record(self, self._buffer, self.device.alloc_pinned(numel * self.host_copies, dtype))
            self._host = [slab[i * numel : (i + 1) * numel].view(shape) for i in range(self.host_copies)]
        self._device_buffers = [self.device.empty(numel, dtype).view(shape) for _ in range(_DEVICE_BUFFERS)]
        self._shape, self._dtype = shape, dtype

    def release(self, index: int, consumed: Event) -> None:
        """The compute that read block ``index``'s input has been issued; ``consumed`` marks its end."""
        self._buffer_free[index % 2] = consumed


class ActivationStash(_BlockInputBuffers):
    def __init__(self, device: Device, num_blocks: int, *, ledger: AllocationLedger | None = None) -> None:
        super().__init__(device, "activation_stash", ledger)
        self.host_copies = num_blocks  # every block's input stays in host memory until its backward
        self._saved: dict[int, Event] = {}
        self._loaded: dict[int, tuple[int, Event]] = {}

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
            device.copy_to_device(self._device_buffers[buffer], self._host[index], "h2d")  # the device's policy
            self._loaded[index] = (buffer, device.record_event("h2d"))

    def load(self, index: int) -> torch.Tensor:
        """The input of block ``index`` on the device; compute waits (stream-side) for its copy."""
        self.prefetch(index)
        buffer, event = self._loaded.pop(index)
        self.device.wait_event("compute", event)
        return self._device_buffers[buffer]


class TierActivationStash(_BlockInputBuffers):
    """The same contract as :class:`ActivationStash`, with block inputs kept on a :class:`Tier` (NVMe).

    For models whose boundary activations do not fit in host RAM. Two pinned staging buffers carry the
    bytes between the device and the tier; the tier's I/O runs on the engine's transfer threads, so the
    forward only waits when the disk falls two blocks behind.

    Note [Activation staging ordering]: a staging buffer is refilled (by a device-to-host copy in the
    forward, or by a tier read in the backward) only after the tier write or the host-to-device copy that
    last read it has completed. Tested by ``test_activations_on_a_tier_are_bit_identical``.

    Note [Direct activation I/O]: a tier that ``moves_device_memory`` (GPUDirect Storage) gets the block
    input itself, with no host staging: the d2h thread waits for the compute that produced it, then
    writes it, holding a reference so the allocator cannot hand its memory out before the write is done.
    In the backward the h2d thread waits for the compute that last read a device buffer, then reads
    into it. Two writes and two reads are in flight at most, as with staging.
    """

    def __init__(
        self, device: Device, tier: Any, workers: Any, *, prefix: str = "act", ledger: AllocationLedger | None = None
    ) -> None:
        super().__init__(device, "nvme_staging", ledger)
        self.direct = bool(getattr(tier, "moves_device_memory", False))
        self.host_copies = 0 if self.direct else TIER_STAGING_COPIES  # staging only: the tier holds the inputs
        self.tier = tier
        self.workers = workers
        self.prefix = prefix
        self._staging_busy: list[Any] = [None, None]  # future of the last job that read the staging buffer
        self._loaded: dict[int, tuple[int, Any]] = {}

    def _key(self, index: int) -> str:
        return f"{self.prefix}/{index}"

    def _wait_staging(self, buffer: int, what: str) -> None:
        busy = self._staging_busy[buffer]
        if busy is not None:
            self.workers.wait(busy, what)

    def save(self, index: int, x: torch.Tensor, computed: Event) -> None:
        buffer = index % 2
        self._wait_staging(buffer, f"the disk write of an activation before staging block {index}")
        if self.direct:  # see Note [Direct activation I/O]
            self._staging_busy[buffer] = self.workers["d2h"].submit(self._write_direct, index, x, computed)
            return
        device = self.device
        with device.stream("d2h"):
            device.wait_event("d2h", computed)
            self._host[buffer].copy_(x, non_blocking=True)
            device.keep_alive(x, "d2h")
            copied = device.record_event("d2h")
        self._staging_busy[buffer] = self.workers["d2h"].submit(self._write, index, buffer, copied)

    def _write(self, index: int, buffer: int, copied: Event) -> None:
        copied.synchronize()  # note: CPU-GPU sync point (d2h thread)
        self.workers.wait(self.tier.put(self._key(index), self._host[buffer]), f"writing activation {index}")

    def _write_direct(self, index: int, x: torch.Tensor, computed: Event) -> None:
        computed.synchronize()  # note: CPU-GPU sync point (d2h thread)
        self.workers.wait(self.tier.put(self._key(index), x), f"writing activation {index}")

    def prefetch(self, index: int) -> None:
        if index in self._loaded or index < 0:
            return
        buffer = index % 2
        previous = self._staging_busy[buffer]
        job = self.workers["h2d"].submit(self._read, index, buffer, previous, self._buffer_free[buffer])
        self._staging_busy[buffer] = job
        self._loaded[index] = (buffer, job)

    def _read(self, index: int, buffer: int, previous: Any, free: Event | None) -> Event:
        if previous is not None:
            result = self.workers.wait(previous, f"the staging buffer before reading activation {index}")
            if isinstance(result, Event):
                result.synchronize()  # the previous h2d from this staging buffer has finished
        device = self.device
        if self.direct:  # see Note [Direct activation I/O]
            if free is not None:
                free.synchronize()  # the compute that last read this device buffer has finished
            target = self._device_buffers[buffer]
            self.workers.wait(self.tier.get(self._key(index), target), f"reading activation {index}")
            return device.record_event("h2d")
        staging = self._host[buffer]
        self.workers.wait(self.tier.get(self._key(index), staging), f"reading activation {index}")
        with device.stream("h2d"):
            if free is not None:
                device.wait_event("h2d", free)
            device.copy_to_device(self._device_buffers[buffer], staging, "h2d")  # the device's policy
            return device.record_event("h2d")

    def load(self, index: int) -> torch.Tensor:
        self.prefetch(index)
        buffer, job = self._loaded.pop(index)
        event = self.workers.wait(job, f"activation {index} from the tier")
        self.device.wait_event("compute", event)
        return self._device_buffers[buffer]
