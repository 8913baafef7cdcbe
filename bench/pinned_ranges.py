"""Does a page-locked sub-range of a pageable host slab copy at PCIe speed? One chunk's host-to-device rate
for sub-ranges registered with ``cudaHostRegister`` (slide_core's ``pin_host_range``) at page-aligned and
unaligned starts, of several sizes, and after neighbouring pages were given back (``madvise``).

    python bench/pinned_ranges.py
"""

from __future__ import annotations

import torch

from slide_core.devices.cuda import CUDADevice
from slide_core.host_memory import release_pages

GIB = 2**30


def rate(source: torch.Tensor, target: torch.Tensor) -> float:
    stream = torch.cuda.Stream()
    best = 0.0
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            target.copy_(source, non_blocking=True)
            end.record()
        end.synchronize()
        best = max(best, source.numel() * source.element_size() / start.elapsed_time(end) / 1e6)
    return best


def main() -> None:
    chunk = 2**24
    target = torch.empty(chunk, device="cuda")
    cases = [
        ("aligned start, 3 GiB", 0, 3 * GIB, None),
        ("aligned start, 5 GiB", 0, 5 * GIB, None),
        ("offset 76800 B, 3 GiB", 76800, 3 * GIB, None),
        ("offset 76800 B, 5 GiB", 76800, 5 * GIB, None),
        ("offset 4 B, 1 GiB", 4, 1 * GIB, None),
        ("aligned, 1 GiB, pages before released first", 2 * GIB, 1 * GIB, (0, 2 * GIB + 1000)),
        ("aligned, 1 GiB, pages before released after", 2 * GIB, 1 * GIB, "after"),
    ]
    two_ranges(chunk, target)
    for name, offset_bytes, size_bytes, release in cases:
        with CUDADevice(0) as device:
            slab = torch.empty((offset_bytes + size_bytes) // 4 + chunk, dtype=torch.float32)
            slab.uniform_()
            lo = offset_bytes // 4
            part = slab[lo : lo + size_bytes // 4]
            if isinstance(release, tuple):
                release_pages(slab[release[0] // 4 : release[1] // 4])
            device.pin_host_range(part)
            if release == "after":
                release_pages(slab[: lo - 1])
            first = rate(part[:chunk], target)
            middle = rate(part[part.numel() // 2 : part.numel() // 2 + chunk], target)
            print(f"{name}: pinned {part.is_pinned()}, first chunk {first:.1f} GB/s, middle chunk {middle:.1f} GB/s")
            del part
        del slab


def two_ranges(chunk: int, target: torch.Tensor, *, release: bool = True, gap_bytes: float = 1.75 * GIB) -> None:
    """The engine's layout when resident units sit between streamed ones (Gemma 3: a streamed embedding,
    two resident blocks, six streamed blocks): two registrations in one slab around given-back pages."""
    sizes = (3.75 * GIB, gap_bytes, 5 * GIB)
    with CUDADevice(0) as device:
        slab = torch.empty(int(sum(sizes)) // 4, dtype=torch.float32)
        slab.uniform_()
        first_end, gap_end = int(sizes[0]) // 4 + 19200, int(sizes[0] + sizes[1]) // 4 + 50304
        first, gap, second = slab[:first_end], slab[first_end:gap_end], slab[gap_end:]
        if release:
            release_pages(gap)
        device.pin_host_range(first)
        device.pin_host_range(second)
        for name, part in (("first", first), ("second", second)):
            print(
                f"two registrations (gap {gap_bytes / GIB:.2f} GiB, released {release}), {name} range: first chunk {rate(part[:chunk], target):.1f} GB/s, "
                f"middle {rate(part[part.numel() // 2 : part.numel() // 2 + chunk], target):.1f} GB/s"
            )
    del slab


if __name__ == "__main__":
    main()
