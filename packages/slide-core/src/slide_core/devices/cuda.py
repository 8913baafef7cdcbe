"""The CUDA device: named streams, events, one pinned slab allocator and a memory cap.

torch.cuda on ROCm builds speaks HIP through the same API; slide-rocm subclasses this device to change
policies, not mechanics.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from slide_core.device import STREAM_ROLES, Device, DeviceFacts, Event, StreamRole


def _memory_fraction(index: int) -> float:
    """The caching allocator's per-process memory fraction on GPU ``index`` now (1.0 when this torch
    cannot say: it predates ``get_per_process_memory_fraction``)."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return 1.0 if getter is None else float(getter(index))


class _CudaEvent(Event):
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def synchronize(self) -> None:
        self.event.synchronize()  # note: CPU-GPU sync point

    def query(self) -> bool:
        return bool(self.event.query())

    def elapsed_ms(self, end: Event) -> float:
        assert isinstance(end, _CudaEvent)
        return float(self.event.elapsed_time(end.event))


class CUDADevice(Device):
    """One CUDA GPU. Streams are created in ``open`` and belong to this instance."""

    backend = "cuda"

    def __init__(self, index: int = 0, memory_limit_bytes: int | None = None) -> None:
        super().__init__(memory_limit_bytes)
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda device needs a CUDA build of torch and a visible GPU; try --device cpu")
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"cuda device index {index} out of range (found {torch.cuda.device_count()})")
        self.index = index
        self._streams: dict[StreamRole, torch.cuda.Stream] = {}
        self._registered: list[torch.Tensor] = []
        self._fraction_found: float | None = None

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def _open_resources(self) -> None:
        torch.cuda.set_device(self.index)
        # The compute stream is the current stream, so library code that is not stream-aware (HF layers,
        # kernels) lands on it without being told.
        self._streams = {
            "compute": torch.cuda.current_stream(self.index),
            "h2d": torch.cuda.Stream(self.index),
            "d2h": torch.cuda.Stream(self.index),
        }
        if self.memory_limit_bytes is not None:
            total = torch.cuda.get_device_properties(self.index).total_memory
            self._fraction_found = _memory_fraction(self.index)
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.memory_limit_bytes / total), self.index)

    def _close_resources(self) -> None:
        torch.cuda.synchronize(self.index)
        self._streams = {}
        for tensor in self._registered:
            torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        self._registered = []
        if self._fraction_found is not None:
            # The cap this device found, not 1.0: closing a capped device inside another one's lifetime
            # must leave the outer cap in force.
            torch.cuda.set_per_process_memory_fraction(self._fraction_found, self.index)
            self._fraction_found = None

    def facts(self) -> DeviceFacts:
        props = torch.cuda.get_device_properties(self.index)
        return DeviceFacts(
            name=props.name,
            backend=self.backend,
            total_memory_bytes=int(props.total_memory),
            multiprocessor_count=int(props.multi_processor_count),
            warp_size=int(getattr(props, "warp_size", 32)),
            max_num_warps=32,
        )

    def _require(self, role: StreamRole) -> torch.cuda.Stream:
        if role not in STREAM_ROLES:
            raise ValueError(f"unknown stream role {role!r}; expected one of {STREAM_ROLES}")
        if not self._streams:
            raise RuntimeError("CUDADevice is closed; use it inside `with device:`")
        return self._streams[role]

    def stream(self, role: StreamRole) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self._require(role))

    def record_event(self, role: StreamRole, *, timing: bool = False) -> Event:
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self._require(role))
        return _CudaEvent(event)

    def wait_event(self, role: StreamRole, event: Event) -> None:
        assert isinstance(event, _CudaEvent)
        self._require(role).wait_event(event.event)

    def keep_alive(self, tensor: torch.Tensor, role: StreamRole) -> None:
        tensor.record_stream(self._require(role))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)  # note: CPU-GPU sync point

    def alloc_pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Page-lock an ordinary host allocation in place.

        ``torch.empty(pin_memory=True)`` goes through the caching host allocator, which rounds every
        request up to a power of two: a 12 GB master slab would pin 16 GB. Registering the exact bytes
        avoids that waste. The device keeps the tensor alive until ``close`` unregisters it.
        """
        tensor = torch.empty(numel, dtype=dtype)
        if tensor.numel() == 0:
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        status = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        if int(status) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed with status {int(status)}")
        self._registered.append(tensor)
        return tensor

    def pin_host_range(self, tensor: torch.Tensor) -> None:
        """``cudaHostRegister`` the bytes under ``tensor`` (as :meth:`alloc_pinned` does for a whole
        allocation); unregistered by ``close``."""
        if tensor.numel() == 0 or tensor.is_pinned():
            return
        nbytes = tensor.numel() * tensor.element_size()
        status = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        if int(status) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed with status {int(status)}")
        self._registered.append(tensor)

    def unpin_host_range(self, tensor: torch.Tensor) -> None:
        for index, registered in enumerate(self._registered):
            if registered is tensor:
                torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
                del self._registered[index]
                return

    def memory_allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.index))

    def peak_memory_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.index))

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)
