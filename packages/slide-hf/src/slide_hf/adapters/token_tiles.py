"""Per-token modules run over tiles of tokens, so that a long sequence never holds their full intermediates.

Why: in a Llama-style block the MLP's ``gate``, ``up``, ``act(gate)`` and their product are each (tokens x
intermediate): at 131,072 tokens of Llama-3.1-8B that is 3.5 GiB per tensor in bf16, four of them saved for
autograd and as many gradients in the backward; an RMSNorm keeps fp32 copies of its (tokens x hidden) input.
Every token's MLP and norm is independent of every other's, so the same numbers come out of any split of
the tokens into tiles.

:class:`TokenTilesFunction` is one ``torch.autograd.Function`` over the whole micro-batch:

- forward: each tile's output is written into one output buffer, under no grad; only the input and the
  weights are saved (the weights are the engine's own tensors, no copy);
- backward: each tile is computed again with grad and differentiated at once (``torch.autograd.grad``), its
  input gradient written into one buffer and its weight gradients added into accumulators, fp32 where the
  weights are in a lower precision (a sum over many tiles in bf16 would lose the small ones), cast back to
  the weights' dtype at the end. The peak holds one tile's intermediates.

The weights arrive as arguments of the Function, so their gradients leave through autograd like any other
op's: the engine's ``torch.autograd.grad(y, [x, *params], grad_out)`` of a block (slide_core's
micro_batch_walk.py) gets them without knowing that a module was tiled.

Which modules run this way: slide_hf/adapters/tiled_mlp.py (dense gated MLPs) and tiled_norm.py (RMSNorms).
Each rebinds a module's ``forward`` to one that reads the model's :class:`SeqTiling` at call time: while the
input is at most one tile (or tiling is off) it calls the forward it replaced, unchanged; above, it runs the
Function (or, under no grad, the same loop). HF's decoder layer runs inside ``functional_call``, so a weight
read in the rebound forward is the tensor the engine bound for this call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

__all__ = ["SeqTiling", "TileForward", "TokenTilesFunction", "run_over_tiles", "tiling_of", "use_seq_tile"]


@dataclass
class SeqTiling:
    """How many tokens (rows) one tile holds; 0 turns tiling off. One per model, read by its blocks' rebound
    forwards at call time (so a plan can measure the model at another tile, and a run sets its own)."""

    tile_tokens: int = 0

    def engages(self, tokens: int) -> bool:
        """Whether an input of ``tokens`` rows (all leading dimensions together) is split into tiles."""
        return 0 < self.tile_tokens < tokens

    def engages_for(self, x: torch.Tensor) -> bool:
        """:meth:`engages` for the rows of ``x`` (its last dimension the features)."""
        return self.engages(x.numel() // max(1, x.shape[-1]))


TileForward = Callable[[torch.Tensor, Sequence[torch.Tensor | None]], torch.Tensor]
"""``(rows of one tile, params) -> output rows``: one tile of a per-token module, differentiable."""


def _tile_starts(rows: int, tile: int) -> range:
    return range(0, rows, tile)


class TokenTilesFunction(torch.autograd.Function):
    """``tile_forward`` over tiles of ``tile`` rows of ``x`` (its last dimension the features); see the module
    docstring. ``params`` are the tensors ``tile_forward`` takes besides the rows (``None`` for an absent
    one, a projection's missing bias)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tile: int, tile_forward: TileForward, *params: Any) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = _tiles_forward(rows, tile, tile_forward, params)
        ctx.tile, ctx.tile_forward = tile, tile_forward
        ctx.save_for_backward(x, *params)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *params = ctx.saved_tensors
        wants_x = ctx.needs_input_grad[0]
        wants = [p is not None and ctx.needs_input_grad[3 + i] for i, p in enumerate(params)]
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(rows) if wants_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        for start in _tile_starts(rows.shape[0], ctx.tile):
            end = start + ctx.tile
            with torch.enable_grad():
                x_tile = rows[start:end].detach().requires_grad_(wants_x)
                bound = [
                    None if p is None else p.detach().requires_grad_(want)
                    for p, want in zip(params, wants, strict=True)
                ]
                y_tile = ctx.tile_forward(x_tile, bound)
                targets = ([x_tile] if wants_x else []) + [p for p, want in zip(bound, wants, strict=True) if want]
                grads = list(torch.autograd.grad(y_tile, targets, grad_rows[start:end]))
            if wants_x:
                cast(torch.Tensor, grad_x)[start:end] = grads.pop(0)
            for i, want in enumerate(wants):
                if want:
                    sums[i] = _accumulate(sums[i], grads.pop(0))
        grad_params = [
            None if total is None else total.to(cast(torch.Tensor, p).dtype)
            for total, p in zip(sums, params, strict=True)
        ]
        grad_in = None if grad_x is None else grad_x.reshape(x.shape)
        return (grad_in, None, None, *grad_params)


def _tiles_forward(
    rows: torch.Tensor, tile: int, tile_forward: TileForward, params: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """Every tile's output written into one (rows, out) buffer, under no grad."""
    out: torch.Tensor | None = None
    with torch.no_grad():
        for start in _tile_starts(rows.shape[0], tile):
            y_tile = tile_forward(rows[start : start + tile], params)
            if out is None:
                out = y_tile.new_empty((rows.shape[0], y_tile.shape[-1]))
            out[start : start + tile] = y_tile
    assert out is not None  # rows > tile >= 1, so at least one tile ran
    return out


def _accumulate(total: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
    """``total + grad``, kept in fp32 when ``grad`` is in a lower precision (the first tile's grad starts it)."""
    if total is None:
        return grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
    return total.add_(grad)


def run_over_tiles(x: torch.Tensor, tile: int, tile_forward: TileForward, params: Sequence[Any]) -> torch.Tensor:
    """``tile_forward`` of ``x`` (any leading dimensions) over tiles of ``tile`` rows: through the Function when
    a gradient is wanted, else the same loop with nothing kept."""
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in params))
    if wants_grad:
        out: torch.Tensor = TokenTilesFunction.apply(x, tile, tile_forward, *params)
        return out
    rows = x.reshape(-1, x.shape[-1])
    y = _tiles_forward(rows, tile, tile_forward, params)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def tiling_of(model: Any) -> SeqTiling | None:
    """The model's :class:`SeqTiling` (the adapters' models have one), or None for a model that does not tile."""
    tiling = getattr(model, "seq_tiling", None)
    return tiling if isinstance(tiling, SeqTiling) else None


def use_seq_tile(model: Any, tile_tokens: int) -> None:
    """Run ``model``'s MLPs and norms over tiles of ``tile_tokens`` tokens from now on (0: untiled); a model without
    tiling (not one of the adapters') is left as it is."""
    tiling = tiling_of(model)
    if tiling is not None:
        tiling.tile_tokens = tile_tokens
