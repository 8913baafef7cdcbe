"""The best-fit free list behind the pinned slab."""

from __future__ import annotations

import random

import pytest

from slide_io._ranges import RangeAllocator


def test_alloc_is_aligned_best_fit_and_free_coalesces() -> None:
    ranges = RangeAllocator(4096, alignment=256)
    assert ranges.span(1) == 256 and ranges.span(256) == 256 and ranges.span(257) == 512
    a, b, c = ranges.alloc(512), ranges.alloc(1024), ranges.alloc(256)
    assert (a, b, c) == (0, 512, 1536)
    ranges.free(a, 512)  # hole of 512 at 0, hole of 2304 at the end
    assert ranges.alloc(256) == 0  # best fit picks the small hole, keeping the big one whole
    ranges.free(0, 256)
    ranges.free(b, 1024)
    ranges.free(c, 256)
    assert ranges.free_bytes() == 4096 and ranges.largest_free() == 4096
    assert ranges.alloc(4096) == 0


def test_full_returns_none_and_claim_undoes_free() -> None:
    ranges = RangeAllocator(1024, alignment=256)
    start = ranges.alloc(768)
    assert ranges.alloc(512) is None
    ranges.free(start, 768)
    ranges.claim(start, 768)
    assert ranges.free_bytes() == 256
    with pytest.raises(ValueError):
        ranges.claim(0, 256)
    with pytest.raises(ValueError):
        ranges.free(768, 256)  # already free


def test_random_workload_matches_a_byte_map() -> None:
    rng = random.Random(1234)
    ranges = RangeAllocator(1 << 16, alignment=256)
    used = bytearray(1 << 16)
    live: list[tuple[int, int]] = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            start, span = live.pop(rng.randrange(len(live)))
            used[start : start + span] = bytes(span)
            ranges.free(start, span)
        else:
            span = ranges.span(rng.randint(1, 6000))
            start = ranges.alloc(span)
            if start is None:
                assert ranges.largest_free() < span
                continue
            assert start % 256 == 0 and not any(used[start : start + span])
            used[start : start + span] = b"\x01" * span
            live.append((start, span))
        assert ranges.free_bytes() == (1 << 16) - sum(used)
