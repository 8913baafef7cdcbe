"""A simulated ROCm (or CUDA) build of torch, and stand-in hipFile bindings, on a CPU-only machine.

The helpers patch exactly what slide-rocm and the CUDA device it extends touch: ``torch.version.hip``,
device discovery and properties, streams, events, ``cudart`` host registration, ``pin_memory=True`` and
``Tensor.is_pinned``. Pinned memory is simulated by remembering the storages that were "pinned"; "device"
tensors are ordinary CPU tensors, so copies can be checked byte for byte.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

MI300X = SimpleNamespace(
    name="AMD Instinct MI300X",
    total_memory=192 * 2**30,
    multi_processor_count=304,
    warp_size=64,
    gcnArchName="gfx942:sramecc+:xnack-",
)
H200 = SimpleNamespace(name="NVIDIA H200", total_memory=141 * 2**30, multi_processor_count=132, warp_size=32)


class FakeStream:
    """torch.cuda.Stream stand-in: work is synchronous, so waiting on an event is a no-op."""

    def __init__(self, name: str = "side") -> None:
        self.name = name
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    """torch.cuda.Event stand-in: work is synchronous, so it is done when recorded."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded_on: object | None = None
        self.synchronized = 0

    def record(self, stream: object = None) -> None:
        self.recorded_on = stream

    def synchronize(self) -> None:
        self.synchronized += 1

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 0.0


@dataclass
class FakeGPU:
    """What a simulated build has seen: pinned storages, registrations, streams entered."""

    pinned: set[int] = field(default_factory=set)
    keep: list[torch.Tensor] = field(default_factory=list)
    registered: dict[int, int] = field(default_factory=dict)
    unregistered: list[int] = field(default_factory=list)
    pin_memory_calls: list[int] = field(default_factory=list)
    streams_entered: list[object] = field(default_factory=list)
    register_honoured: bool = True
    memory_fraction: float = 1.0
    """The caching allocator's per-process cap, as ``set_per_process_memory_fraction`` left it."""

    def mark_pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        # Keep the tensor alive so its address cannot be reused by a pageable allocation.
        self.keep.append(tensor)
        self.pinned.add(tensor.untyped_storage().data_ptr())
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in self.pinned


def install(monkeypatch: pytest.MonkeyPatch, props: SimpleNamespace, hip: str | None) -> FakeGPU:
    gpu = FakeGPU()
    real_empty = torch.empty

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        tensor = real_empty(*args, **kwargs)
        if pin_memory:
            gpu.pin_memory_calls.append(tensor.numel() * tensor.element_size())
            gpu.mark_pinned(tensor)
        return tensor

    def host_register(ptr: int, nbytes: int, flags: int) -> int:
        gpu.registered[ptr] = nbytes
        if gpu.register_honoured:
            gpu.pinned.add(ptr)
        return 0

    def host_unregister(ptr: int) -> int:
        gpu.registered.pop(ptr, None)
        gpu.pinned.discard(ptr)
        gpu.unregistered.append(ptr)
        return 0

    @contextlib.contextmanager
    def stream(s: object) -> Iterator[None]:
        gpu.streams_entered.append(s)
        yield

    cudart = SimpleNamespace(cudaHostRegister=host_register, cudaHostUnregister=host_unregister)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.version, "cuda", None if hip else "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    compute = FakeStream("compute")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: compute)
    monkeypatch.setattr(torch.cuda, "Stream", lambda index=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: None)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, index=None: _set_fraction(gpu, f))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index=None: gpu.memory_fraction)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index=None: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda index=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda index=None: None)
    # "Device" tensors are host tensors here, so there is no allocator to tell which stream uses them.
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: gpu.is_pinned(self))
    return gpu


def _set_fraction(gpu: FakeGPU, fraction: float) -> None:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"invalid fraction {fraction}")
    gpu.memory_fraction = fraction


# -- hipFile bindings -------------------------------------------------------------------------------------
class FakeHipFileException(Exception):
    """Stands in for hipfile.HipFileException (a plain Exception subclass in the real bindings)."""


def make_fake_hipfile(*, with_io: bool = True) -> ModuleType:
    """A module shaped like ROCm/hipFile's ``hipfile`` package, doing POSIX I/O on host addresses.

    ``with_io=False`` gives the older API whose FileHandle had no read/write methods.
    """
    module = ModuleType("hipfile")
    state = SimpleNamespace(driver_open=0, registered=set(), fail_next=None, short_next=False)

    class Driver:
        def open(self) -> None:
            state.driver_open += 1

        def close(self) -> None:
            state.driver_open -= 1

    class Buffer:
        def __init__(self, ptr: int, length: int, flags: int) -> None:
            self.ptr, self.length = ptr, length

        def __enter__(self) -> Buffer:
            state.registered.add(self.ptr)
            return self

        def __exit__(self, *exc: object) -> None:
            state.registered.discard(self.ptr)

    class FileHandle:
        def __init__(self, path: Any, flags: int, mode: int = 0o644) -> None:
            # tmpfs refuses O_DIRECT; the real library would take the direct path or fall back to POSIX.
            self.path, self.flags, self.mode = path, flags & ~getattr(os, "O_DIRECT", 0), mode
            self.requested_flags = flags
            self.fd: int | None = None

        def __enter__(self) -> FileHandle:
            state.last_flags = self.requested_flags
            self.fd = os.open(self.path, self.flags, self.mode)
            return self

        def __exit__(self, *exc: object) -> None:
            assert self.fd is not None
            os.close(self.fd)

    def _io_check(buffer: Buffer) -> None:
        if state.fail_next is not None:
            error, state.fail_next = state.fail_next, None
            raise error
        assert buffer.ptr in state.registered, "buffer used without registration"

    def read(self: FileHandle, buffer: Buffer, size: int, file_offset: int, buffer_offset: int) -> int:
        _io_check(buffer)
        data = os.pread(self.fd, size, file_offset)
        if state.short_next:
            state.short_next, data = False, data[: size // 2]
        ctypes.memmove(buffer.ptr + buffer_offset, data, len(data))
        return len(data)

    def write(self: FileHandle, buffer: Buffer, size: int, file_offset: int, buffer_offset: int) -> int:
        _io_check(buffer)
        return os.pwrite(self.fd, ctypes.string_at(buffer.ptr + buffer_offset, size), file_offset)

    if with_io:
        FileHandle.read = read  # type: ignore[attr-defined]
        FileHandle.write = write  # type: ignore[attr-defined]
    module.Driver = Driver  # type: ignore[attr-defined]
    module.FileHandle = FileHandle  # type: ignore[attr-defined]
    module.HipFileException = FakeHipFileException  # type: ignore[attr-defined]
    module.state = state  # type: ignore[attr-defined]
    # Buffer lives only in a submodule, as in some binding versions, so the tier must look there.
    buffer_module = ModuleType("hipfile.buffer")
    buffer_module.Buffer = Buffer  # type: ignore[attr-defined]
    module.buffer_module = buffer_module  # type: ignore[attr-defined]
    return module
