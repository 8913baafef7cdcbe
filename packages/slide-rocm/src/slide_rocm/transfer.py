"""The ROCm transfer rule: host-to-device copies come only from pinned (page-locked) host memory.

Why it is a rule on ROCm and only a performance hint on CUDA: when ``hipMemcpyAsync`` is handed a pageable
host pointer, the HIP runtime pins that range in place (or bounces it through small internal buffers) for
the duration of the copy. The copy turns synchronous with the host, and the pinning serializes behind, and
stalls, the work already queued on the GPU. The sliding-window schedule relies on uploads overlapping
compute, so one pageable upload quietly undoes the overlap for the whole step. We therefore refuse pageable
sources loudly, or, when the policy asks for it, copy them through a pinned staging slab we own.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from slide_core.device import Event

__all__ = ["PageableSourceError", "StagingBuffer", "check_h2d_source", "format_bytes"]


class PageableSourceError(ValueError):
    """A host-to-device copy was asked for from pageable host memory."""


def format_bytes(nbytes: int) -> str:
    """``1536`` -> ``"1.50 KiB"``: sizes in error messages people read."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def check_h2d_source(tensor: torch.Tensor) -> None:
    """Raise :class:`PageableSourceError` when ``tensor`` is pageable host memory.

    Device tensors pass (a device-to-device copy involves no host pages), and so do pinned host tensors.
    """
    if tensor.device.type != "cpu" or tensor.is_pinned():
        return
    nbytes = tensor.numel() * tensor.element_size()
    raise PageableSourceError(
        "refusing a host-to-device copy from pageable memory: a "
        f"{tuple(tensor.shape)} {tensor.dtype} tensor of {format_bytes(nbytes)} ({nbytes} bytes). "
        "On ROCm a pageable source is pinned in place by the HIP runtime for every copy, which makes the "
        "copy synchronous and stalls the GPU queues. Allocate the source with device.alloc_pinned(...), "
        "or build the device with ROCmPolicy(stage_pageable=True) to copy it through a pinned staging slab."
    )


class StagingBuffer:
    """A pinned slab, split in two halves, through which pageable host tensors reach the device.

    While the DMA engine drains one half, the host fills the other, so a staged copy costs one extra host
    memcpy rather than a stalled queue. Before a half is refilled the host waits for the copy that last
    read it; that wait is the price of staging and the reason pinned sources remain the rule.
    """

    def __init__(
        self,
        slab: torch.Tensor,
        stream: Callable[[str], AbstractContextManager[Any]],
        record_event: Callable[[str], Event],
    ) -> None:
        if slab.dtype != torch.uint8 or slab.dim() != 1 or slab.numel() < 2:
            raise ValueError(f"staging slab must be a flat uint8 tensor of at least 2 bytes, got {slab.shape}")
        half = slab.numel() // 2
        self._halves = (slab[:half], slab[half : 2 * half])
        self._last_use: list[Event | None] = [None, None]
        self._stream = stream
        self._record_event = record_event

    @property
    def half_bytes(self) -> int:
        return self._halves[0].numel()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, role: str) -> Event:
        """Copy host ``src`` into ``dst`` on the ``role`` stream; the returned event marks the end."""
        src_bytes = src.reshape(-1).view(torch.uint8)
        dst_bytes = dst.view(-1).view(torch.uint8)
        for index, start in enumerate(range(0, src_bytes.numel(), self.half_bytes)):
            slot = index % 2
            previous = self._last_use[slot]
            if previous is not None:
                previous.synchronize()  # note: CPU-GPU sync point; the half is still being read by DMA
            count = min(self.half_bytes, src_bytes.numel() - start)
            staged = self._halves[slot][:count]
            staged.copy_(src_bytes[start : start + count])
            with self._stream(role):
                dst_bytes[start : start + count].copy_(staged, non_blocking=True)
            self._last_use[slot] = self._record_event(role)
        return self._record_event(role)

    def drain(self) -> None:
        """Wait until neither half is being read. note: CPU-GPU sync point."""
        for event in self._last_use:
            if event is not None:
                event.synchronize()
        self._last_use = [None, None]
