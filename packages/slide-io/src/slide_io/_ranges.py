"""A best-fit free list over the byte ranges of one slab.

The pinned tier owns a single page-locked slab (one pinning call, no per-tensor ``pin_memory`` and no
power-of-two rounding by the caching host allocator) and hands out ranges of it. Best fit keeps large holes
intact for the big per-unit tensors; freeing coalesces neighbours so the slab does not fragment over a
training run in which the same sizes come and go every step.
"""

from __future__ import annotations

import bisect

from slide_io._bytes import round_up

__all__ = ["RangeAllocator"]


class RangeAllocator:
    """Hands out ``alignment``-aligned ``[start, start + span)`` ranges of a ``total``-byte region.

    Not thread-safe: the owning tier serialises calls with its lock.
    """

    def __init__(self, total: int, alignment: int = 256) -> None:
        if total < 0 or alignment <= 0:
            raise ValueError(f"need total >= 0 and alignment > 0, got {total} and {alignment}")
        self.total = total
        self.alignment = alignment
        # Sorted by start, never adjacent (adjacent holes are merged), never empty.
        self._holes: list[tuple[int, int]] = [(0, total)] if total else []

    def span(self, nbytes: int) -> int:
        """The bytes a request for ``nbytes`` occupies: rounded up so every start stays aligned."""
        return round_up(nbytes, self.alignment)

    def alloc(self, span: int) -> int | None:
        """Start of a free range of ``span`` bytes (a multiple of the alignment), or None if none fits."""
        if span == 0:
            return 0
        best = -1
        for index, (_, size) in enumerate(self._holes):
            if size >= span and (best < 0 or size < self._holes[best][1]):
                best = index
                if size == span:
                    break
        if best < 0:
            return None
        start, size = self._holes[best]
        if size == span:
            del self._holes[best]
        else:
            self._holes[best] = (start + span, size - span)
        return start

    def free(self, start: int, span: int) -> None:
        """Return ``[start, start + span)`` and merge it with the holes on either side."""
        if span == 0:
            return
        index = bisect.bisect_left(self._holes, (start, 0))
        end = start + span
        if index < len(self._holes) and self._holes[index][0] < end:
            raise ValueError(f"range [{start}, {end}) overlaps a free range: double free?")
        if index > 0 and sum(self._holes[index - 1]) > start:
            raise ValueError(f"range [{start}, {end}) overlaps a free range: double free?")
        if index < len(self._holes) and self._holes[index][0] == end:
            end += self._holes.pop(index)[1]
        if index > 0 and sum(self._holes[index - 1]) == start:
            start = self._holes[index - 1][0]
            index -= 1
            self._holes.pop(index)
        self._holes.insert(index, (start, end - start))

    def claim(self, start: int, span: int) -> None:
        """Take back exactly ``[start, start + span)``, which must be free (undoes a ``free``)."""
        if span == 0:
            return
        index = bisect.bisect_right(self._holes, (start, self.total + 1)) - 1
        if index < 0:
            raise ValueError(f"range [{start}, {start + span}) is not free")
        hole_start, hole_size = self._holes[index]
        hole_end = hole_start + hole_size
        if start + span > hole_end:
            raise ValueError(f"range [{start}, {start + span}) is not free")
        pieces = [(hole_start, start - hole_start), (start + span, hole_end - start - span)]
        self._holes[index : index + 1] = [piece for piece in pieces if piece[1] > 0]

    def free_bytes(self) -> int:
        return sum(size for _, size in self._holes)

    def largest_free(self) -> int:
        return max((size for _, size in self._holes), default=0)
