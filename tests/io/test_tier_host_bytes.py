"""A tier's own host memory: what ``host_bytes_for`` says a tier built for a run will hold (the plan's price)
is what the open tier's ``host_bytes`` counts on its buffers' storages, and nothing once it is closed."""

from __future__ import annotations

from pathlib import Path

import torch

from slide_core.tier import TierRequest
from slide_core.tiers.host_ram import HostRamTier
from slide_io import PinnedRamTier
from slide_io.tiers.posix_nvme import PosixNvmeTier


def test_the_pinned_slab_is_its_price_whatever_it_stores() -> None:
    request = TierRequest(capacity_bytes=3_000_001)
    tier = PinnedRamTier.for_run(request)
    assert tier.host_bytes() == 0  # nothing until open
    with tier:
        slab = tier._slab
        assert slab is not None
        assert tier.host_bytes() == PinnedRamTier.host_bytes_for(request) == slab.untyped_storage().nbytes()
        tier.put("a", torch.ones(1000)).result()
        assert tier.host_bytes() == PinnedRamTier.host_bytes_for(request)
    assert tier.host_bytes() == 0


def test_the_nvme_bounce_buffers_are_their_price(tmp_path: Path) -> None:
    request = TierRequest(directory=tmp_path)
    tier = PosixNvmeTier.for_run(request)
    with tier:
        measured = sum(buffer.untyped_storage().nbytes() for buffer in tier._bounce_buffers)
        assert len(tier._bounce_buffers) == tier.io_threads
        assert tier.host_bytes() == measured == PosixNvmeTier.host_bytes_for(request) > 0
        tier.put("a", torch.ones(1000)).result()
        assert tier.host_bytes() == measured  # keys go to files
    assert tier.host_bytes() == 0


def test_a_tier_in_memory_holds_what_it_stores() -> None:
    with HostRamTier() as tier:
        assert tier.host_bytes() == HostRamTier.host_bytes_for(TierRequest()) == 0
        tier.put("a", torch.ones(1000)).result()
        tier.put("b", torch.ones(10, dtype=torch.bfloat16)).result()
        assert tier.host_bytes() == 4000 + 20
        tier.delete("a")
        assert tier.host_bytes() == 20
