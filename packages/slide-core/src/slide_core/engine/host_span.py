"""The page-locked spans of an unpinned host master, and the host pages they keep.

When the caller allocates the master unpinned (``HostParameters(model)``), the engine page-locks the part
of the plane the host-to-device copy reads (``HostParameters.h2d_source``: the fp32 slab, or a split
master's bf16 plane) that this rank streams, and gives back the pages of device-resident units (Note
[Resident host copies] in docs/design/engine.md). This module decides those spans and which resident
pages stay inside them; slide_hf's planner prices the same spans from the same rule.

Note [One registration per allocation]: measured on an H200 host (bench/pinned_ranges.py, ``two_ranges``),
a second registered range inside one host allocation copies to the device at 6-9 GB/s, pageable speed,
while the first registered range of that allocation copies at 54 GB/s, with or without released pages
between the two. A Gemma 3 12B placement (a streamed embedding, resident blocks 0-1, then streamed blocks)
had two runs of host-updated units and so two registrations: every streamed block after the resident ones
loaded at pageable speed and its blocks ran 15x slow, where a slab pinned whole ran every block at
resident speed. So the spans (:func:`pinned_spans`) join this rank's host-updated extents where they are
contiguous and across a gap that device-resident units fill: a resident unit's pages inside a span are
then not given back (a locked page cannot be released; it stays resident with the registration), and
the planner counts them (slide_hf/planner/memory.py ``pinned_master_numel``). In one process every gap
between host-updated units is resident, so the plane gets one registration.

A gap that holds another rank's shards is never bridged: under data parallelism a rank's shards of
consecutive units have the other ranks' shards between them, and a span over those would lock (hence
hold) nearly the whole copied plane on every rank instead of 1/N of it (docs/distributed.md's 70B
projection on 64 ranks: 263 GiB of fp32 slab per rank in place of 4.1 GiB). So a rank registers one span
per contiguous stretch of its own shards, and all but the first of them copy at pageable speed: a known
limit. The way out is a shard-major layout of the slab (each rank's shards of all units in one contiguous
block), which would make a rank's shards one stretch and so one span. Only the plane the copy reads is
registered here: a split master's low bits and tie bits never cross PCIe, so they keep no span and a
resident unit's part of them is given back as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["outside", "pinned_spans"]


def pinned_spans(extents: Iterable[tuple[int, int]], bridges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges ``[start, end)`` of the copied plane to page-lock, in order (Note [One registration per
    allocation]). ``extents`` are this rank's ``[start, end)`` of each host-updated unit in the plane's
    elements, in any order; ``bridges`` are the device-resident units' ranges. Consecutive extents join
    into one span where they touch or where the gap between them lies wholly within ``bridges``; empty
    extents are dropped, so there is no span when every unit is resident."""
    covered = _union(bridges)
    spans: list[tuple[int, int]] = []
    for start, end in sorted((start, end) for start, end in extents if end > start):
        if spans and (start <= spans[-1][1] or _covers(covered, spans[-1][1], start)):
            spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
        else:
            spans.append((start, end))
    return spans


def _union(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` as disjoint, sorted ranges, touching ones joined."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted((start, end) for start, end in ranges if end > start):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _covers(union: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether the disjoint, sorted ``union`` holds every element of ``[start, end)``."""
    return any(lo <= start and end <= hi for lo, hi in union)


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
