"""The longest sequence the GPU and host budgets hold at a batch of one, and what the planned one needs:
`slide plan`'s "longest seq-len" line and its JSON keys. The tiling a run of each length takes is priced by
slide_hf/planner/seq_tiles.py, through the byte model (slide_hf/planner/memory.py); the tile ``--seq-tile
auto`` takes is slide_hf/planner/auto_tile.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slide_hf.planner.auto_tile import auto_seq_tile, auto_tiles
from slide_hf.planner.inputs import PlanInputs
from slide_hf.planner.memory import _gpu_peak, _host_peak

__all__ = ["SequenceFit", "longest_seq_len", "sequence_fit"]

LONGEST_SEARCHED = 1 << 24
"""The longest ``--seq-len`` :func:`longest_seq_len` looks for, where the model's positions do not stop it first."""


@dataclass(frozen=True)
class SequenceFit:
    """How long a sequence the GPU budget holds, for `slide plan`'s "long sequences" line and its JSON."""

    seq_tile: int
    """Tokens per MLP tile of the planned run (0: untiled), as ``--seq-tile`` resolved."""
    seq_tile_auto: bool
    """The planner chose ``seq_tile`` (``--seq-tile auto``, the default) rather than the user."""
    seq_len_gpu_bytes: int
    """The GPU peak of the planned ``--seq-len`` at a batch of one (before any unit is made resident)."""
    longest_seq_len: int | None
    """The longest ``--seq-len`` whose run at a batch of one fits the GPU budget and the host's; None without
    a GPU budget."""
    positions_bound: bool = False
    """The model's positions stop the search before the budgets do."""
    host_bound: bool = False
    """Host RAM stops the search before the GPU budget does (the run one token longer needs more of it)."""

    @property
    def limit(self) -> str:
        """What stops the search: ``positions``, ``host`` or ``gpu``."""
        return "positions" if self.positions_bound else "host" if self.host_bound else "gpu"

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_tile": self.seq_tile,
            "seq_tile_source": "auto" if self.seq_tile_auto else "--seq-tile",
            "seq_len_gpu_bytes": self.seq_len_gpu_bytes,
            "longest_seq_len": self.longest_seq_len,
            "longest_seq_len_limit": self.limit,
        }


def sequence_fit(
    inputs: PlanInputs, gpu_cap: int | None, seq_tile: int | None, *, positions: int | None = None
) -> SequenceFit:
    """The :class:`SequenceFit` of ``inputs`` under ``gpu_cap`` and ``inputs``' host budget; ``seq_tile`` as
    the user gave it (None: each length's default), ``positions`` the model's context length (the longest
    ``--seq-len`` a run takes)."""
    at_batch_one = _gpu_peak(inputs.shape, dataclasses.replace(inputs, batch_size=1))
    auto = seq_tile is None
    if gpu_cap is None:
        return SequenceFit(inputs.seq_tile, auto, at_batch_one, None)
    host_cap = inputs.host_memory_bytes
    limit = min(positions, LONGEST_SEARCHED) if positions else LONGEST_SEARCHED
    longest = longest_seq_len(inputs, gpu_cap, seq_tile, limit=limit, host_cap=host_cap)
    positions_bound = bool(positions) and longest == limit
    stopped = None if longest == limit else _length_blocker(inputs, max(longest + 1, 2), gpu_cap, host_cap, seq_tile)
    return SequenceFit(
        inputs.seq_tile, auto, at_batch_one, longest, positions_bound=positions_bound, host_bound=stopped == "host"
    )


def longest_seq_len(
    inputs: PlanInputs,
    gpu_cap: int,
    seq_tile: int | None,
    *,
    limit: int = LONGEST_SEARCHED,
    host_cap: int | None = None,
) -> int:
    """The longest ``seq_len`` (at most ``limit``) whose run at a batch of one fits ``gpu_cap`` and, given,
    ``host_cap`` (:func:`_length_blocker`), with ``inputs``' other options and ``seq_tile`` as the user gave
    it (None: ``auto``). 0 when not even 2 tokens fit. Both peaks grow with the length, so a doubling search
    then bisection finds it in a few dozen evaluations of the byte model (each length's block measurements on
    the meta device take milliseconds), and the length one token longer does not fit."""
    return _bisect(lambda seq_len: _length_blocker(inputs, seq_len, gpu_cap, host_cap, seq_tile) is None, limit)


def _length_blocker(
    inputs: PlanInputs, seq_len: int, gpu_cap: int, host_cap: int | None, seq_tile: int | None
) -> str | None:
    """What a run of ``seq_len`` tokens at a batch of one does not fit, as `slide plan` and `slide train`
    check it: ``"gpu"`` (the GPU peak before any unit is placed), ``"host"`` (the host peak once the GPU
    budget's spare memory holds resident units, whose master and moments then leave the host), or None."""
    at = dataclasses.replace(inputs, batch_size=1, seq_len=seq_len)
    if not _fits_gpu(at, gpu_cap, seq_tile):
        return "gpu"
    if host_cap is None:
        return None
    run = dataclasses.replace(at, seq_tile=auto_seq_tile(at, gpu_cap) if seq_tile is None else seq_tile)
    return None if _fits_host(run, host_cap) else "host"


def _fits_gpu(inputs: PlanInputs, gpu_cap: int, seq_tile: int | None) -> bool:
    """Whether ``inputs`` fit ``gpu_cap`` with ``seq_tile`` as given (None: ``auto``, which fits untiled or
    at its smallest tile if at all: the peak grows with the tile)."""

    def peak(tile: int) -> int:
        return _gpu_peak(inputs.shape, dataclasses.replace(inputs, seq_tile=tile))

    tokens = inputs.batch_size * inputs.seq_len
    if seq_tile is not None:
        return peak(seq_tile if 0 < seq_tile < tokens else 0) <= gpu_cap
    smallest = auto_tiles(tokens)[-1:] or [0]
    return peak(0) <= gpu_cap or peak(smallest[0]) <= gpu_cap


def _fits_host(inputs: PlanInputs, host_cap: int) -> bool:
    """Whether the run of ``inputs`` fits ``host_cap`` once placed as ``--update-placement host`` places it
    (the default; streaming updates to the GPU only takes more off the host). Placing takes a plan or two,
    so only where the unplaced host peak, which placing never raises, does not fit already."""
    if _host_peak(inputs.shape, inputs) <= host_cap:
        return True
    from slide_hf.planner.plan import plan_with_placement  # plan.py plans other batches with this module

    return plan_with_placement(inputs, "host").host_peak_bytes <= host_cap


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
