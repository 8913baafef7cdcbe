"""The Device interface: where compute runs and how bytes reach it.

A device owns its streams (one per role: compute, host-to-device, device-to-host), a pinned-host slab
allocator, an optional memory cap and the hardware facts kernels ask for. The engine never talks to
``torch.cuda`` directly; it asks its device, so the same schedule runs on CUDA, ROCm and the CPU.

Devices are created closed. ``open()`` (or ``with device:``) creates streams and pools; ``close()`` frees
them and is safe to call twice.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from slide_core._lifecycle import Lifecycle

__all__ = ["Device", "DeviceFacts", "Event", "StreamRole", "num_warps_for"]

StreamRole = str
"""One of ``"compute"``, ``"h2d"`` or ``"d2h"``."""

STREAM_ROLES: tuple[StreamRole, ...] = ("compute", "h2d", "d2h")

_WARP_STEPS: tuple[tuple[int, int], ...] = ((32768, 32), (8192, 16), (2048, 8))
"""(smallest block size, warps) for row-wise kernels; smaller blocks get 4 warps. The steps are the usual
Triton recipe for rows (one program per row, vectorised 16-byte loads); :func:`num_warps_for` caps them."""


def num_warps_for(block_size: int, *, warp_size: int = 32, max_num_warps: int = 32) -> int:
    """Warps per program for a row-wise Triton kernel whose widest block holds ``block_size`` elements.

    The one warp-count rule: slide-kernels' launchers and slide-rocm's ``launch_params`` both call it.
    More warps for longer rows, but never past ``max_num_warps`` (a workgroup holds 1024 lanes: 32 warps
    of 32 on NVIDIA, only 16 wavefronts of 64 on AMD, where more fails to compile or spills), and never
    past the warps the block can keep busy (``block_size // warp_size``); a power of two, as Triton needs.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if warp_size < 1 or max_num_warps < 1:
        raise ValueError(f"warp_size and max_num_warps must be >= 1, got {warp_size} and {max_num_warps}")
    steps = next((warps for size, warps in _WARP_STEPS if block_size >= size), 4)
    warps = min(steps, max_num_warps, block_size // warp_size)
    return 1 << (warps.bit_length() - 1) if warps >= 1 else 1  # Triton takes powers of two only


@dataclass(frozen=True)
class DeviceFacts:
    """Hardware facts that kernels and the planner ask for."""

    name: str
    backend: str  # "cuda", "rocm" or "cpu"
    total_memory_bytes: int
    multiprocessor_count: int
    warp_size: int
    max_num_warps: int

    def num_warps(self, block_size: int) -> int:
        """:func:`num_warps_for` on this hardware."""
        return num_warps_for(block_size, warp_size=self.warp_size, max_num_warps=self.max_num_warps)


class Event(ABC):
    """A point in one stream's work that other streams, or the host, can wait for."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling host thread until the event has completed. note: CPU-GPU sync point."""

    @abstractmethod
    def query(self) -> bool:
        """True when the work before the event is done. Never blocks."""

    @abstractmethod
    def elapsed_ms(self, end: Event) -> float:
        """Device time between this event and ``end``; both must have completed."""


class Device(Lifecycle, ABC):
    """Compute, transfer and pinned memory for one accelerator (or the host CPU)."""

    backend: str = "abstract"

    def __init__(self, memory_limit_bytes: int | None = None) -> None:
        if memory_limit_bytes is not None and memory_limit_bytes <= 0:
            raise ValueError(f"memory_limit_bytes must be positive, got {memory_limit_bytes}")
        self.memory_limit_bytes = memory_limit_bytes

    # -- identity --------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def torch_device(self) -> torch.device:
        """The torch device compute tensors live on."""

    @abstractmethod
    def facts(self) -> DeviceFacts:
        """Hardware facts (name, memory, SM/CU count, warp size)."""

    @property
    def is_accelerator(self) -> bool:
        """False for the host CPU: then 'device' and 'host' memory are the same memory."""
        return self.torch_device.type != "cpu"

    # -- what a run defaults to here -------------------------------------------------------------------
    # A device plugin carries a policy for its hardware (slide-rocm's ROCmPolicy); these are how that
    # policy reaches a run: where the user chose nothing, slide-hf asks the device before its own rule.
    def preferred_activation_tier(self) -> str | None:
        """The ``slide.tiers`` plugin that should hold the block inputs a run sends to NVMe
        (``--offload-activations nvme``) on this device, or None to leave it to the run's own rule
        (GPUDirect Storage where it is real, else the POSIX ``nvme`` tier)."""
        return None

    def preferred_attention(self) -> str | None:
        """The Hugging Face attention implementation (``"sdpa"``, ``"flash_attention_2"``, ...) this device
        prefers for a layer that can run it, or None to leave it to the adapter's rule. A user's explicit
        choice always wins, and a preference a layer cannot honour (a logit cap SDPA would drop) is
        ignored for that layer."""
        return None

    @classmethod
    def doctor_facts(cls) -> dict[str, str]:
        """Lines ``slide doctor`` prints for this device plugin on this machine: its policy and why. Probes
        only; never opens a device. The default says nothing."""
        return {}

    # -- streams and events ----------------------------------------------------------------------------
    @abstractmethod
    def stream(self, role: StreamRole) -> contextlib.AbstractContextManager[Any]:
        """Context in which work is issued on the stream for ``role``."""

    @abstractmethod
    def record_event(self, role: StreamRole, *, timing: bool = False) -> Event:
        """Record an event at the current end of the ``role`` stream."""

    @abstractmethod
    def wait_event(self, role: StreamRole, event: Event) -> None:
        """Make future work on ``role`` wait for ``event`` (no host blocking)."""

    @abstractmethod
    def keep_alive(self, tensor: torch.Tensor, role: StreamRole) -> None:
        """Tell the allocator that ``tensor`` is used by ``role``, so its memory is not reused too early."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all streams. note: CPU-GPU sync point."""

    # -- transfers -------------------------------------------------------------------------------------
    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, role: StreamRole = "h2d") -> Event | None:
        """Copy host ``src`` into the device tensor ``dst`` (same numel and dtype) on the ``role`` stream.

        The engine's parameter uploads go through here, so a device's transfer policy is the one that
        runs in training: the ROCm device refuses pageable sources or stages them (slide_rocm.transfer).
        The default is a plain asynchronous copy. Either way the caller keeps ``src`` alive and unmodified
        until the copy is done, and orders readers of ``dst`` with an event recorded on ``role``. Returns
        the copy's end event when the device records one, else None.
        """
        with self.stream(role):
            dst.copy_(src, non_blocking=True)
        return None

    # -- memory ----------------------------------------------------------------------------------------
    @abstractmethod
    def alloc_pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """One host tensor the device can copy to and from at full speed (page-locked on GPUs)."""

    def pin_host_range(self, tensor: torch.Tensor) -> None:
        """Page-lock the memory under an existing host tensor (e.g. part of a larger slab) until ``close``,
        so copies from it run at full speed. Host devices need nothing. Already-pinned memory is left alone."""

    def unpin_host_range(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`pin_host_range` for exactly that tensor before ``close`` (the device keeps a
        reference to what it pinned, so memory its owner frees stays allocated until then). Host devices
        need nothing; a tensor this device did not pin is left alone."""

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat device tensor, counted against the memory cap."""
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def memory_allocated_bytes(self) -> int:
        return 0

    def peak_memory_bytes(self) -> int:
        return 0

    def reset_peak_memory(self) -> None:
        pass

    @contextlib.contextmanager
    def autocast(self, dtype: torch.dtype) -> Iterator[None]:
        """Compute happens in the dtype of the bound parameters; no autocast is needed by default."""
        yield
