"""The CPU device: the engine's schedule with host tensors and no-op streams.

It exists so every engine feature runs, and is tested, on a machine without a GPU. Work is issued
synchronously, so events are always complete and waits are no-ops; the schedule, the optimizer thread
and the host-side bookkeeping are exactly those of the GPU path.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch

from slide_core.device import Device, DeviceFacts, Event, StreamRole


class _HostEvent(Event):
    """Work on the CPU device is synchronous, so an event is complete when recorded."""

    def __init__(self) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_ms(self, end: Event) -> float:
        assert isinstance(end, _HostEvent)
        return (end._t - self._t) * 1e3


class CPUDevice(Device):
    """Runs compute on the host. Pinned memory is ordinary memory."""

    backend = "cpu"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def facts(self) -> DeviceFacts:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return DeviceFacts(
            name="cpu",
            backend="cpu",
            total_memory_bytes=total,
            multiprocessor_count=os.cpu_count() or 1,
            warp_size=1,
            max_num_warps=1,
        )

    def stream(self, role: StreamRole) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def record_event(self, role: StreamRole, *, timing: bool = False) -> Event:
        return _HostEvent()

    def wait_event(self, role: StreamRole, event: Event) -> None:
        return None

    def keep_alive(self, tensor: torch.Tensor, role: StreamRole) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def alloc_pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)
