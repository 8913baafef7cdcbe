"""What tiling the blocks' MLPs and norms over tokens (``--seq-tile``, slide_hf/adapters/token_tiles.py) changes
in a plan (the longest sequence that fits a budget is slide_hf/planner/seq_fit.py's).

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

from slide_hf.planner.inputs import ModelShape, PlanInputs

__all__ = ["engaged_tile", "mlp_tokens", "tiled_saved_bytes", "tiling_buffer_bytes"]


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
