"""Triton launch parameters for row-wise kernels (RMSNorm, SwiGLU, RoPE), derived from device facts.

The usual recipe (one program per row, ``BLOCK_SIZE`` the row rounded up to a power of two, more warps for
longer rows) hard-codes 32 warps for the longest rows. That is a CUDA number: a workgroup holds at most
1024 lanes, which is 32 warps of 32 on NVIDIA but only 16 wavefronts of 64 on AMD, and Triton's AMD backend
fails to compile, or spills, above that. The warp count is slide-core's one rule
(:func:`slide_core.device.num_warps_for`, the one slide-kernels launches with), capped by
:class:`~slide_core.DeviceFacts`, so one recipe is correct on both.
"""

from __future__ import annotations

from dataclasses import dataclass

from slide_core.device import DeviceFacts, num_warps_for

__all__ = ["MAX_BLOCK_SIZE", "LaunchParams", "launch_params_for", "next_power_of_two"]

MAX_BLOCK_SIZE = 65536
"""Largest ``BLOCK_SIZE`` in elements; longer rows are walked in blocks by the kernel."""


@dataclass(frozen=True)
class LaunchParams:
    """``num_warps`` and ``BLOCK_SIZE`` for one Triton launch; both are powers of two."""

    num_warps: int
    block_size: int


def next_power_of_two(n: int) -> int:
    """The smallest power of two that is ``>= n`` (``n >= 1``)."""
    if n < 1:
        raise ValueError(f"next_power_of_two needs n >= 1, got {n}")
    return 1 << (n - 1).bit_length()


def launch_params_for(facts: DeviceFacts, row_numel: int, *, max_block_size: int = MAX_BLOCK_SIZE) -> LaunchParams:
    """Launch parameters for a kernel that processes one row of ``row_numel`` elements per program.

    ``num_warps`` grows with the block, but never past ``facts.max_num_warps`` (16 on ROCm, 32 on CUDA) and
    never past the warps the block can keep busy (``block_size // warp_size``).
    """
    if isinstance(row_numel, bool) or not isinstance(row_numel, int) or row_numel < 1:
        raise ValueError(f"row_numel must be a positive int, got {row_numel!r}")
    if max_block_size < 1 or max_block_size & (max_block_size - 1):
        raise ValueError(f"max_block_size must be a power of two, got {max_block_size}")
    block_size = min(next_power_of_two(row_numel), max_block_size)
    num_warps = num_warps_for(block_size, warp_size=facts.warp_size, max_num_warps=facts.max_num_warps)
    return LaunchParams(num_warps=num_warps, block_size=block_size)
