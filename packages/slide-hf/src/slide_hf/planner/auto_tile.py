"""The tile ``--seq-tile auto`` takes (:func:`auto_seq_tile`), for the planned batch and for the other batches
a search tries (:func:`at_batch`).

A smaller tile holds less (one tile's share of the MLP intermediates) and launches more kernels, and a tiled
block's backward runs its MLP forward once more; so untiled where that fits, else the largest power-of-two
tile that fits, no smaller than :data:`~slide_hf.defaults.AUTO_SEQ_TILE_FLOOR` unless only a smaller one
fits. The priced peak grows with the tile, so the first fit from the top is the largest. `slide plan` and
`slide train` both choose it in slide_hf/setup.py's ``plan_inputs`` from the same inputs, so the tile a plan
prints is the tile the run takes. Its own module because slide_hf/planner/plan.py's batch search needs it
and slide_hf/planner/seq_fit.py's length search needs plan.py.
"""

from __future__ import annotations

import dataclasses

from slide_hf.defaults import AUTO_SEQ_TILE_FLOOR, AUTO_SEQ_TILE_MIN, resolve_seq_tile
from slide_hf.planner.inputs import PlanInputs
from slide_hf.planner.memory import _gpu_peak

__all__ = ["AutoSeqTile", "at_batch", "auto_seq_tile", "auto_tiles"]


class AutoSeqTile(int):
    """A tile :func:`auto_seq_tile` chose (``--seq-tile auto``), as ``PlanInputs.seq_tile`` keeps it: an ``int``
    to everything that prices or runs it. The mark is for the searches that plan other batches of the same
    run (slide_hf/planner/plan.py's ``largest_batch``): `slide train` at another ``--batch-size`` takes the tile
    auto chooses for that batch, while a tile the user gave stays as given, and PlanInputs has no other
    record of which it is. ``dataclasses.replace`` keeps the mark; a ``seq_tile`` given anew drops it."""

    __slots__ = ()


def auto_seq_tile(inputs: PlanInputs, gpu_cap: int | None) -> int:
    """The tile ``--seq-tile auto`` runs ``inputs`` with under ``gpu_cap`` (module docstring); without a
    budget, :func:`~slide_hf.defaults.resolve_seq_tile`'s fixed default. Where nothing fits, the floor (or,
    for a micro-batch shorter than it, the largest tile below it): the plan then says by how much."""
    return AutoSeqTile(_auto_choice(inputs, gpu_cap))


def _auto_choice(inputs: PlanInputs, gpu_cap: int | None) -> int:
    """:func:`auto_seq_tile`'s tile, unmarked."""
    if gpu_cap is None:
        return resolve_seq_tile(None, inputs.seq_len)
    shape = inputs.shape
    if _gpu_peak(shape, dataclasses.replace(inputs, seq_tile=0)) <= gpu_cap:
        return 0
    tiles = auto_tiles(inputs.batch_size * inputs.seq_len)
    for tile in tiles:
        if _gpu_peak(shape, dataclasses.replace(inputs, seq_tile=tile)) <= gpu_cap:
            return tile
    at_floor = [tile for tile in tiles if tile >= AUTO_SEQ_TILE_FLOOR]
    return at_floor[-1] if at_floor else (tiles[0] if tiles else 0)


def at_batch(inputs: PlanInputs, batch_size: int) -> PlanInputs:
    """``inputs`` at ``batch_size`` rows per micro-batch, with the tile the run of that batch takes: where
    ``auto`` chose the planned tile (:class:`AutoSeqTile`), the one it chooses for this batch, as slide_hf/
    setup.py's ``plan_inputs`` would (before any unit is placed, within the inputs' GPU budget); a tile the
    user gave, as given. A larger batch may fit only in smaller tiles, a smaller one untiled."""
    trial = dataclasses.replace(inputs, batch_size=batch_size)
    if not isinstance(inputs.seq_tile, AutoSeqTile):
        return trial
    unplaced = dataclasses.replace(trial, resident_units=(), streamed_units=(), streamable_units=())
    return dataclasses.replace(trial, seq_tile=auto_seq_tile(unplaced, inputs.gpu_memory_bytes))


def auto_tiles(tokens: int) -> list[int]:
    """The tiles ``auto`` tries for a micro-batch of ``tokens``, largest first: the powers of two below it,
    down to :data:`~slide_hf.defaults.AUTO_SEQ_TILE_MIN`, and none past the largest tile ``--seq-tile``
    accepts (PlanInputs refuses a larger one, naming an option the user may never have given)."""
    tiles, tile, largest = [], AUTO_SEQ_TILE_MIN, _largest_tile()
    while tile < tokens and tile <= largest:
        tiles.append(tile)
        tile *= 2
    return tiles[::-1]


def _largest_tile() -> int:
    """The largest ``--seq-tile``: its option's rule, which PlanInputs checks every tile against."""
    from slide_hf.options import RULES  # the planner reads the options' rules where it needs them (inputs.py)

    high = RULES["seq_tile"].high
    assert high is not None  # the rule is a closed range
    return int(high)
