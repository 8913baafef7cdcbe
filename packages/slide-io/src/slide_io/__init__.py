"""slide-io: storage tiers for SlideFormer beyond plain host RAM.

``PinnedRamTier`` (one page-locked slab), ``PosixNvmeTier`` (files, O_DIRECT when possible) and
``GdsTier`` (GPUDirect Storage via kvikio, falling back to POSIX). They register as the ``pinned``,
``nvme`` and ``gds`` entries of the ``slide.tiers`` plugin group. Importing this package never imports
kvikio; ``gds_status()`` reports on it for ``slide doctor``.
"""

from slide_io._kvikio import gds_status
from slide_io.tiers import GdsTier, PinnedRamTier, PosixNvmeTier

__all__ = ["GdsTier", "PinnedRamTier", "PosixNvmeTier", "gds_status"]
