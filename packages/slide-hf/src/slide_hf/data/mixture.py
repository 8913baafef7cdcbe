"""The order of rows in one epoch of a weighted mixture of sources (``--data a --data b --data-weights 3,1``).

An epoch draws as many rows as the sources hold together. Source ``i`` gets ``weight_i / sum(weights)`` of
them, rounded by largest remainder so the counts add up exactly. The shares are exact fractions
(:func:`weight_shares`), so any positive finite weights work: ``1e308,1e308``, whose float sum is infinite,
is the same even mixture as ``1,1``. Each source yields its rows as an endless
stream of passes, each pass a fresh seeded permutation: epoch ``e`` takes the next ``count`` items of the
stream, so a source asked for more rows than it holds repeats them (each pass in a fresh order), and one
asked for fewer continues through its rows over the following epochs. Which source each
position of the epoch takes from is a seeded shuffle of those counts, so the sources interleave evenly.

The order is a pure function of (seed, epoch, weights, the sources' row counts). The data position a
checkpoint saves, ``(epoch, index)``, is therefore the sampler's whole state: a resumed run recomputes the
epoch's order and continues at ``index`` with exactly the rows the uninterrupted run would have seen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import torch

__all__ = ["mixture_counts", "mixture_order", "weight_shares"]


def _seed(seed: int, source: int, number: int) -> int:
    """A generator seed for one draw, apart from the plain ``seed + epoch`` permutations of one pool."""
    return (seed * 1_000_003 + (source + 2) * 7_919 + number * 104_729) % 2**63


def _exact_shares(weights: Sequence[float]) -> list[Fraction]:
    """``weight_i / sum(weights)`` as exact fractions: a float sum of large weights overflows to infinity
    (and the shares to NaN), and rounding would make a tie between equal remainders depend on the order
    of a sum."""
    exact = [Fraction(weight) for weight in weights]
    scale = sum(exact)
    return [weight / scale for weight in exact]


def weight_shares(weights: Sequence[float]) -> list[float]:
    """The fraction of an epoch's rows each source gets (positive finite ``weights``, of any magnitude)."""
    return [float(share) for share in _exact_shares(weights)]


def mixture_counts(rows: Sequence[int], weights: Sequence[float], total: int) -> list[int]:
    """How many of ``total`` draws each source gets: proportional to ``weights``, by largest remainder."""
    exact = [total * share for share in _exact_shares(weights)]
    counts = [math.floor(value) for value in exact]
    by_remainder = sorted(range(len(rows)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _stream(held: int, first: int, count: int, *, seed: int, source: int, shuffle: bool) -> torch.Tensor:
    """Items ``[first, first + count)`` of one source's endless stream of passes over its ``held`` rows,
    each pass a fresh seeded permutation (or file order): a source sampled below its size moves on through
    its rows from one epoch to the next instead of drawing the same subset, and one sampled above it
    repeats every row before any row a third time."""
    if count == 0 or held == 0:
        return torch.empty(0, dtype=torch.int64)
    passes = []
    for number in range(first // held, (first + count - 1) // held + 1):
        if shuffle:
            generator = torch.Generator().manual_seed(_seed(seed, source, number))
            passes.append(torch.randperm(held, generator=generator))
        else:
            passes.append(torch.arange(held))
    offset = first - (first // held) * held
    return torch.cat(passes)[offset : offset + count]


def mixture_order(
    rows: Sequence[int], weights: Sequence[float], *, seed: int, epoch: int, shuffle: bool = True
) -> torch.Tensor:
    """Row indices (into the sources' rows laid end to end) of epoch ``epoch``, ``sum(rows)`` long.

    ``shuffle=False`` keeps each source's own rows in file order, passes without permutation (the sources
    still interleave by the seeded draw, which is what the weights mean)."""
    if len(rows) != len(weights):
        raise ValueError(f"{len(weights)} weights for {len(rows)} sources")
    if any(held < 1 for held in rows):
        raise ValueError(f"a weighted source holds no rows (rows per source: {list(rows)})")
    total = sum(rows)
    counts = mixture_counts(rows, weights, total)
    starts = [sum(rows[:i]) for i in range(len(rows))]
    picks = [
        _stream(held, wanted * epoch, wanted, seed=seed, source=i, shuffle=shuffle) + start
        for i, (start, held, wanted) in enumerate(zip(starts, rows, counts, strict=True))
    ]
    generator = torch.Generator().manual_seed(_seed(seed, -1, epoch))
    sources = torch.cat([torch.full((count,), i, dtype=torch.int64) for i, count in enumerate(counts)])
    sources = sources[torch.randperm(total, generator=generator)]
    order = torch.empty(total, dtype=torch.int64)
    for i, taken in enumerate(picks):
        order[sources == i] = taken
    return order
