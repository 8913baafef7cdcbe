"""The tile ``--seq-tile auto`` takes, the longest sequence a GPU budget holds at a batch of one, and what the
planned one needs: `slide plan`'s "longest seq-len" line and its JSON keys. The tiling a run of each length
takes is priced by slide_hf/planner/seq_tiles.py, through the byte model (slide_hf/planner/memory.py).

``auto`` (:func:`auto_seq_tile`): a smaller tile holds less (one tile's share of the MLP intermediates) and
launches more kernels, and a tiled block's backward runs its MLP forward once more; so untiled where that
fits, else the largest power-of-two tile that fits, no smaller than :data:`~slide_hf.defaults.AUTO_SEQ_TILE_FLOOR`
unless only a smaller one fits. The priced peak grows with the tile, so the first fit from the top is the
largest. `slide plan` and `slide train` both choose it in slide_hf/setup.py's ``plan_inputs`` from the same
inputs, so the tile a plan prints is the tile the run takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slide_hf.defaults import AUTO_SEQ_TILE_FLOOR, AUTO_SEQ_TILE_MIN, resolve_seq_tile
from slide_hf.planner.inputs import PlanInputs
from slide_hf.planner.memory import _gpu_peak

__all__ = ["SequenceFit", "auto_seq_tile", "longest_seq_len", "sequence_fit"]


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
    """The longest ``--seq-len`` whose GPU peak at a batch of one fits the budget; None without a budget."""
    positions_bound: bool = False
    """The model's positions stop the search before the GPU budget does."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_tile": self.seq_tile,
            "seq_tile_source": "auto" if self.seq_tile_auto else "--seq-tile",
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
    auto = seq_tile is None
    if gpu_cap is None:
        return SequenceFit(inputs.seq_tile, auto, at_batch_one, None)
    limit = min(positions, 1 << 24) if positions else 1 << 24
    longest = longest_seq_len(inputs, gpu_cap, seq_tile, limit=limit)
    bound = bool(positions) and longest == limit
    return SequenceFit(inputs.seq_tile, auto, at_batch_one, longest, positions_bound=bound)


def auto_seq_tile(inputs: PlanInputs, gpu_cap: int | None) -> int:
    """The tile ``--seq-tile auto`` runs ``inputs`` with under ``gpu_cap`` (module docstring); without a
    budget, :func:`~slide_hf.defaults.resolve_seq_tile`'s fixed default. Where nothing fits, the floor (or,
    for a micro-batch shorter than it, the largest tile below it): the plan then says by how much."""
    if gpu_cap is None:
        return resolve_seq_tile(None, inputs.seq_len)
    shape = inputs.shape
    if _gpu_peak(shape, dataclasses.replace(inputs, seq_tile=0)) <= gpu_cap:
        return 0
    tiles = _auto_tiles(inputs.batch_size * inputs.seq_len)
    for tile in tiles:
        if _gpu_peak(shape, dataclasses.replace(inputs, seq_tile=tile)) <= gpu_cap:
            return tile
    at_floor = [tile for tile in tiles if tile >= AUTO_SEQ_TILE_FLOOR]
    return at_floor[-1] if at_floor else (tiles[0] if tiles else 0)


def _auto_tiles(tokens: int) -> list[int]:
    """The tiles ``auto`` tries for a micro-batch of ``tokens``, largest first: the powers of two below it,
    down to :data:`~slide_hf.defaults.AUTO_SEQ_TILE_MIN`."""
    tiles, tile = [], AUTO_SEQ_TILE_MIN
    while tile < tokens:
        tiles.append(tile)
        tile *= 2
    return tiles[::-1]


def longest_seq_len(inputs: PlanInputs, gpu_cap: int, seq_tile: int | None, *, limit: int = 1 << 24) -> int:
    """The longest ``seq_len`` (at most ``limit``) whose GPU peak fits ``gpu_cap`` at a batch of one, with
    ``inputs``' other options and ``seq_tile`` as the user gave it (None: ``auto``, which at each length
    fits untiled or at its smallest tile if at any: the peak grows with the tile). 0 when not even 2 tokens
    fit. The peak grows with the length, so a doubling search then bisection finds it in a few dozen
    evaluations of the byte model (each length's block measurements on the meta device take milliseconds)."""
    shape = inputs.shape

    def peak(seq_len: int, tile: int) -> int:
        return _gpu_peak(shape, dataclasses.replace(inputs, batch_size=1, seq_len=seq_len, seq_tile=tile))

    def fits(seq_len: int) -> bool:
        if seq_tile is not None:
            return peak(seq_len, seq_tile if 0 < seq_tile < seq_len else 0) <= gpu_cap
        smallest = _auto_tiles(seq_len)[-1:] or [0]
        return peak(seq_len, 0) <= gpu_cap or peak(seq_len, smallest[0]) <= gpu_cap

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
