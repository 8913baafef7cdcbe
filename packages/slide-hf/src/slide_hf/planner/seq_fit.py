"""The longest sequence a GPU budget holds at a batch of one, and what the planned one needs: `slide plan`'s
"longest seq-len" line and its JSON keys. The tiling a run of each length takes is priced by
slide_hf/planner/seq_tiles.py, through the byte model (slide_hf/planner/memory.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slide_hf.defaults import resolve_seq_tile
from slide_hf.planner.inputs import PlanInputs
from slide_hf.planner.memory import _gpu_peak

__all__ = ["SequenceFit", "longest_seq_len", "sequence_fit"]


@dataclass(frozen=True)
class SequenceFit:
    """How long a sequence the GPU budget holds, for `slide plan`'s "long sequences" line and its JSON."""

    seq_tile: int
    """Tokens per MLP tile of the planned run (0: untiled), as ``--seq-tile`` resolved."""
    seq_len_gpu_bytes: int
    """The GPU peak of the planned ``--seq-len`` at a batch of one (before any unit is made resident)."""
    longest_seq_len: int | None
    """The longest ``--seq-len`` whose GPU peak at a batch of one fits the budget; None without a budget."""
    positions_bound: bool = False
    """The model's positions stop the search before the GPU budget does."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_tile": self.seq_tile,
            "seq_len_gpu_bytes": self.seq_len_gpu_bytes,
            "longest_seq_len": self.longest_seq_len,
            "longest_seq_len_limit": "positions" if self.positions_bound else "gpu",
        }


def sequence_fit(
    inputs: PlanInputs, gpu_cap: int | None, seq_tile: int | None, *, positions: int | None = None
) -> SequenceFit:
    """The :class:`SequenceFit` of ``inputs`` under ``gpu_cap``; ``seq_tile`` as the user gave it (None:
    each length's default), ``positions`` the model's context length (the longest ``--seq-len`` a run takes)."""
    at_batch_one = _gpu_peak(inputs.shape, dataclasses.replace(inputs, batch_size=1))
    if gpu_cap is None:
        return SequenceFit(inputs.seq_tile, at_batch_one, None)
    limit = min(positions, 1 << 24) if positions else 1 << 24
    longest = longest_seq_len(inputs, gpu_cap, seq_tile, limit=limit)
    return SequenceFit(inputs.seq_tile, at_batch_one, longest, positions_bound=bool(positions) and longest == limit)


def longest_seq_len(inputs: PlanInputs, gpu_cap: int, seq_tile: int | None, *, limit: int = 1 << 24) -> int:
    """The longest ``seq_len`` (at most ``limit``) whose GPU peak fits ``gpu_cap`` at a batch of one, with
    ``inputs``' other options and ``seq_tile`` as the user gave it (None: the default tile of each length,
    as a run of that length resolves it, slide_hf/defaults.py). 0 when not even 2 tokens fit. The peak
    grows with the length, so a doubling search then bisection finds it in a few dozen evaluations of the
    byte model (each length's block measurements on the meta device take milliseconds)."""
    shape = inputs.shape

    def fits(seq_len: int) -> bool:
        tile = resolve_seq_tile(seq_tile, seq_len)
        trial = dataclasses.replace(inputs, batch_size=1, seq_len=seq_len, seq_tile=tile)
        return _gpu_peak(shape, trial) <= gpu_cap

    return _bisect(fits, limit)


def _bisect(fits: Callable[[int], bool], limit: int) -> int:
    """The largest ``n`` in ``[2, limit]`` with ``fits(n)``, for a ``fits`` true up to some point and false
    after it; 0 when ``fits(2)`` is false."""
    if not fits(2):
        return 0
    low, high = 2, 4
    while high <= limit and fits(high):
        low, high = high, high * 2
    if high > limit:
        return limit if fits(limit) else _between(fits, low, limit)
    return _between(fits, low, high)


def _between(fits: Callable[[int], bool], low: int, high: int) -> int:
    """Bisection: ``fits(low)`` holds and ``fits(high)`` does not."""
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low
