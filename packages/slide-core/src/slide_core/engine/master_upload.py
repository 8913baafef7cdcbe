"""The h2d thread's copy of a unit's master into its device slot, in chunks.

Note [Casting uploads]: an fp32 master goes to a bf16 (or fp16) slot. ``slot.copy_(fp32_host_range)`` would
make torch allocate an fp32 device temporary of the chunk for every chunk of every unit of every step, from
the h2d thread, beside the compute stream's own allocations. Instead each pipeline keeps one fp32 device
chunk, allocated with its first upload: the DMA lands in it and a cast kernel on the h2d stream writes the
slot. The h2d stream orders both, so the next chunk's DMA into the same buffer waits for the cast. The
planner prices that chunk from :meth:`MasterUpload.staging_bytes` (one source for the size). A split
master's bf16 plane, or a slot in the master's own dtype, is copied as it is.
"""

from __future__ import annotations

import torch

from slide_core.device import Device

__all__ = ["MasterUpload"]


class MasterUpload:
    """Chunked host-to-device copies of master ranges into slots, on the ``h2d`` stream (the caller
    enters it); used from the h2d thread only."""

    def __init__(self, device: Device, chunk_numel: int) -> None:
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
        self.device = device
        self.chunk_numel = chunk_numel
        self._staging: torch.Tensor | None = None

    @staticmethod
    def staging_bytes(chunk_numel: int, source_dtype_bytes: int, target_dtype_bytes: int) -> int:
        """Device bytes the upload keeps when a source of ``source_dtype_bytes`` per element (the fp32
        master: 4; a split master's bf16 plane: 2) goes into slots of ``target_dtype_bytes``."""
        return 0 if source_dtype_bytes == target_dtype_bytes else chunk_numel * source_dtype_bytes

    def copy(self, target: torch.Tensor, source: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """Copy ``source[lo:hi]`` into ``target[lo:hi]`` chunk by chunk, casting on the device."""
        hi = source.numel() if hi is None else hi
        for offset in range(lo, hi, self.chunk_numel):
            end = min(hi, offset + self.chunk_numel)
            if source.dtype == target.dtype:
                self.device.copy_to_device(target[offset:end], source[offset:end], "h2d")
                continue
            staging = self._stage(source.dtype)[: end - offset]
            self.device.copy_to_device(staging, source[offset:end], "h2d")
            target[offset:end].copy_(staging)  # the cast, on the h2d stream (Note [Casting uploads])

    def _stage(self, dtype: torch.dtype) -> torch.Tensor:
        if self._staging is None or self._staging.dtype != dtype:
            self._staging = self.device.empty(self.chunk_numel, dtype)
        return self._staging
