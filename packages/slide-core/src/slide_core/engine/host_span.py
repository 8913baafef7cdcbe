"""The one page-locked span of an unpinned host master, and the host pages it keeps.

When the caller allocates the master unpinned (``HostParameters(model)``), the engine page-locks the part
of the plane the host-to-device copy reads (``HostParameters.h2d_source``: the fp32 slab, or a split
master's bf16 plane) that this rank streams, and gives back the pages of device-resident units (Note
[Resident host copies] in docs/design/engine.md). This module decides that span and which resident
pages stay inside it; slide_hf's planner prices the same span from the same rule.

Note [One registration per allocation]: the span is one ``cudaHostRegister`` per host allocation, from
this rank's first host-updated byte to its last, whatever lies between: device-resident units, or other
ranks' shards of each unit under data parallelism. Measured on an H200 host (bench/pinned_ranges.py,
``two_ranges``): a second registered range inside one allocation copies to the device at 6-9 GB/s,
pageable speed, while the first registered range of that allocation copies at 54 GB/s, with or without
released pages between the two. A Gemma 3 12B placement (a streamed embedding, resident blocks 0-1,
then streamed blocks) had two runs of host-updated units and so two registrations: every streamed block
after the resident ones loaded at pageable speed and its blocks ran 15x slow, where a slab pinned whole
ran every block at resident speed. The price is the pages inside the span that a range per run would not
have locked: a resident unit's pages there are not given back (a locked page cannot be released; it
stays resident with the registration), and under data parallelism the other ranks' shards between the
first and the last of this rank's are locked too, so a rank holds the copied plane of that span whole.
The planner counts both (slide_hf/planner/memory.py ``pinned_master_numel``). Only the plane the copy
reads is registered: a split master's low bits and tie bits never cross PCIe, so they keep no span and
a resident unit's part of them is given back as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["outside", "pinned_span"]


def pinned_span(shards: Iterable[tuple[int, int]]) -> tuple[int, int] | None:
    """The one range ``[start, end)`` of the copied plane to page-lock (Note [One registration per
    allocation]): from the first to the last element of ``shards``, this rank's ``[start, end)`` of each
    host-updated unit in the plane's elements, in any order. None when there is none (every unit resident)."""
    spans = [(start, end) for start, end in shards if end > start]
    if not spans:
        return None
    return min(start for start, _ in spans), max(end for _, end in spans)


def outside(tensor: torch.Tensor, kept: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parts of the flat host tensor ``tensor`` whose memory is under none of ``kept`` (flat tensors
    too): what may be given back to the OS while ``kept`` stays page-locked. The tensor whole when none
    overlaps it (another plane, another range); nothing when they cover it."""
    parts = [tensor]
    for span in kept:
        parts = [piece for part in parts for piece in _outside_one(part, span)]
    return parts


def _outside_one(tensor: torch.Tensor, kept: torch.Tensor) -> list[torch.Tensor]:
    if tensor.numel() == 0 or kept.numel() == 0:
        return [tensor] if tensor.numel() else []
    itemsize = tensor.element_size()
    start = tensor.data_ptr()
    end = start + tensor.numel() * itemsize
    kept_start = kept.data_ptr()
    kept_end = kept_start + kept.numel() * kept.element_size()
    if kept_end <= start or end <= kept_start:
        return [tensor]
    parts = []
    if kept_start > start:
        parts.append(tensor[: (kept_start - start) // itemsize])
    if kept_end < end:
        first_after = -(-(kept_end - start) // itemsize)  # rounded up: no element partly under ``kept``
        parts.append(tensor[first_after:])
    return parts
