"""The tiers slide-io adds: a pinned host slab, POSIX/O_DIRECT NVMe files, GPUDirect Storage."""

from slide_io.tiers.gds import GdsTier
from slide_io.tiers.pinned_ram import PinnedRamTier
from slide_io.tiers.posix_nvme import PosixNvmeTier

__all__ = ["GdsTier", "PinnedRamTier", "PosixNvmeTier"]
