"""What tiling the blocks' MLPs and norms over tokens (``--seq-tile``, slide_hf/adapters/token_tiles.py) changes
in a plan, and the longest sequence that fits a GPU budget.

A block's backward recomputes its forward with grad and differentiates it while what autograd saved is
alive. Untiled, the MLP's intermediates (gate, up, the activation and the product: four (tokens x
intermediate) tensors for a Llama-style MLP) and the norms' fp32 copies are saved for the whole micro-batch;
tiled, each saves only its input, and its backward recomputes one tile at a time. So the block's saved bytes
become

    saved(tiled) + (saved(untiled) - saved(tiled)) x tile / tokens

-- both measured on the meta device (slide_hf/planner/activations.py), the difference being exactly what
the tiled modules save, of which one tile's share is alive at once -- and the backward holds the tiling's own
buffers beside them (:func:`tiling_buffer_bytes`). The no-grad forward holds one tile's intermediates
instead of the whole micro-batch's (:func:`mlp_tokens`).

Below a tile (``batch x seq_len`` at most ``seq_tile``) nothing changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slide_hf.planner.inputs import ModelShape, PlanInputs

__all__ = [
    "SequenceFit",
    "engaged_tile",
    "longest_seq_len",
    "mlp_tokens",
    "sequence_fit",
    "tiled_saved_bytes",
    "tiling_buffer_bytes",
]


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
    from slide_hf.planner.memory import _gpu_peak

    at_batch_one = _gpu_peak(inputs.shape, dataclasses.replace(inputs, batch_size=1))
    if gpu_cap is None:
        return SequenceFit(inputs.seq_tile, at_batch_one, None)
    limit = min(positions, 1 << 24) if positions else 1 << 24
    longest = longest_seq_len(inputs, gpu_cap, seq_tile, limit=limit)
    return SequenceFit(inputs.seq_tile, at_batch_one, longest, positions_bound=bool(positions) and longest == limit)


def engaged_tile(inputs: PlanInputs) -> int:
    """Tokens per tile when the run's micro-batch is split into tiles, else 0 (the rule of
    :meth:`~slide_hf.adapters.tiled_mlp.SeqTiling.engages`)."""
    tokens = inputs.batch_size * inputs.seq_len
    return inputs.seq_tile if 0 < inputs.seq_tile < tokens else 0


def mlp_tokens(inputs: PlanInputs) -> int:
    """Tokens whose MLP intermediates exist at once: a tile's, or the whole micro-batch's."""
    return engaged_tile(inputs) or inputs.batch_size * inputs.seq_len


def tiled_saved_bytes(tiled: int, untiled: int, inputs: PlanInputs) -> int:
    """A block's saved bytes with its MLP tiled (``tiled``, as measured) plus one tile's share of what the
    untiled MLP saves (``untiled - tiled``): what its backward holds at once (module docstring)."""
    tile = engaged_tile(inputs)
    if not tile:
        return untiled
    tokens = inputs.batch_size * inputs.seq_len
    return tiled + max(0, untiled - tiled) * tile // tokens


def tiling_buffer_bytes(shape: ModelShape, inputs: PlanInputs) -> int:
    """GPU bytes the tiled modules' backward adds while it runs (slide_hf/adapters/token_tiles.py): the gradient
    of the MLP's input for the whole micro-batch, filled tile by tile, and, once the MLP is done, that of the
    norm before it beside it (the norm's gradient in); the MLP's three weight gradients of one tile as
    autograd returns them (compute dtype) and their fp32 sums across tiles. 0 when nothing is tiled (below a
    tile, or a model whose blocks have no tiled module)."""
    if not engaged_tile(inputs):
        return 0
    if shape.activations is not None and not shape.activations.tiles:
        return 0
    d = inputs.compute_dtype_bytes
    tokens = inputs.batch_size * inputs.seq_len
    weights = 3 * shape.hidden_size * shape.intermediate_size
    return 2 * tokens * shape.hidden_size * d + weights * (d + 4)


def longest_seq_len(inputs: PlanInputs, gpu_cap: int, seq_tile: int | None, *, limit: int = 1 << 24) -> int:
    """The longest ``seq_len`` (at most ``limit``) whose GPU peak fits ``gpu_cap`` at a batch of one, with
    ``inputs``' other options and ``seq_tile`` as the user gave it (None: the default tile of each length,
    as a run of that length resolves it, slide_hf/defaults.py). 0 when not even 2 tokens fit. The peak
    grows with the length, so a doubling search then bisection finds it in a few dozen evaluations of the
    byte model (each length's block measurements on the meta device take milliseconds)."""
    from slide_hf.defaults import resolve_seq_tile
    from slide_hf.planner.memory import _gpu_peak

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
