"""A dense gated MLP run over tiles of tokens, so that a long sequence never holds its full intermediates.

Why: in a Llama-style block the MLP's ``gate``, ``up``, ``act(gate)`` and their product are each (tokens x
intermediate): at 131,072 tokens of Llama-3.1-8B that is 3.5 GiB per tensor in bf16, four of them saved for
autograd and as many gradients in the backward. Every token's MLP is independent of every other's, so the
same numbers come out of any split of the tokens into tiles.

:class:`TiledGatedMLPFunction` is one ``torch.autograd.Function`` over the whole micro-batch:

- forward: each tile's ``down(act(gate(x)) * up(x))`` is written into one output buffer, under no grad; only
  the MLP's input and the weights are saved (the weights are the engine's own tensors, no copy);
- backward: each tile is computed again with grad and differentiated at once (``torch.autograd.grad``), its
  input gradient written into one buffer and its weight gradients added into accumulators, fp32 where the
  weights are in a lower precision (a sum over many tiles in bf16 would lose the small ones), cast back to
  the weights' dtype at the end. The peak holds one tile's intermediates.

The weights arrive as arguments of the Function, so their gradients leave through autograd like any other
op's: the engine's ``torch.autograd.grad(y, [x, *params], grad_out)`` of a block (slide_core's
micro_batch_walk.py) gets them without knowing that the MLP was tiled.

:func:`tile_mlps` rebinds the ``forward`` of every dense gated MLP under a unit's root, per instance, on top of
whatever :func:`~slide_hf.adapters.fused_modules.fuse_modules` left there. The rebound forward reads the
model's :class:`SeqTiling` at call time: while the tokens of the input are at most one tile (or tiling is
off) it calls the forward it replaced, unchanged; above, it runs the Function (or, under no grad, the
same loop). The HF decoder layer runs inside ``functional_call``, so ``module.gate_proj.weight`` read in the
forward is the tensor the engine bound for this call.

Note [Tiles compute HF's formula]: a tile computes ``F.linear(act_fn(F.linear(x, Wg, bg)) * F.linear(x, Wu,
bu), Wd, bd)``, what HF's ``LlamaMLP.forward`` (and Qwen's, Gemma's, ...) computes with its ``nn.Linear``
children and ``act_fn``; on CUDA with slide-kernels, ``act_fn(g) * u`` is its fused ``swiglu``/``geglu``, as
the untiled fused forward runs it. Only modules :func:`~slide_hf.adapters.fused_modules.is_gated_mlp`
accepts are tiled (the ``nn.Linear`` children and the config's activation checked);
``test_tiled_mlp.py`` compares whole models against transformers' own forward and backward.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from slide_hf.adapters.fused_modules import GLU_ACTIVATIONS, MLP_PROJECTIONS, is_gated_mlp, runs_fused

__all__ = [
    "SeqTiling",
    "TiledGatedMLPFunction",
    "tile_mlps",
    "tiled_gated_mlp",
    "tiling_of",
    "use_seq_tile",
]

TileForward = Callable[[torch.Tensor, Sequence[torch.Tensor | None]], torch.Tensor]
"""``(x rows of one tile, (Wg, bg, Wu, bu, Wd, bd)) -> output rows``: one tile of the MLP, differentiable."""


@dataclass
class SeqTiling:
    """How many tokens one MLP tile holds; 0 turns tiling off. One per model, read by its blocks' rebound
    MLP forwards at call time (so a plan can measure the model at another tile, and a run sets its own)."""

    tile_tokens: int = 0

    def engages(self, tokens: int) -> bool:
        """Whether an input of ``tokens`` tokens (all leading dimensions together) is split into tiles."""
        return 0 < self.tile_tokens < tokens


def _tile_starts(rows: int, tile: int) -> range:
    return range(0, rows, tile)


class TiledGatedMLPFunction(torch.autograd.Function):
    """The gated MLP over tiles of ``tile`` rows; see the module docstring. ``params`` is
    ``(Wg, bg, Wu, bu, Wd, bd)``, a bias ``None`` where the projection has none."""

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


def tiled_gated_mlp(x: torch.Tensor, tile: int, tile_forward: TileForward, params: Sequence[Any]) -> torch.Tensor:
    """The MLP of ``x`` (any leading dimensions) over tiles of ``tile`` tokens: through the Function when a
    gradient is wanted, else the same loop with nothing kept."""
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in params))
    if wants_grad:
        out: torch.Tensor = TiledGatedMLPFunction.apply(x, tile, tile_forward, *params)
        return out
    rows = x.reshape(-1, x.shape[-1])
    y = _tiles_forward(rows, tile, tile_forward, params)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _tile_forward(act_fn: Callable[[torch.Tensor], torch.Tensor], glu: str | None) -> TileForward:
    """One tile of HF's gated MLP (Note [Tiles compute HF's formula])."""

    def forward(x: torch.Tensor, params: Sequence[torch.Tensor | None]) -> torch.Tensor:
        wg, bg, wu, bu, wd, bd = params
        gate, up = F.linear(x, cast(torch.Tensor, wg), bg), F.linear(x, cast(torch.Tensor, wu), bu)
        if glu is not None and runs_fused(x):
            import slide_kernels

            hidden = getattr(slide_kernels, glu)(gate, up)
        else:
            hidden = act_fn(gate) * up
        return F.linear(hidden, cast(torch.Tensor, wd), bd)

    return forward


def _tiling_forward(module: nn.Module, tiling: SeqTiling, glu: str | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward: the one it had below a tile, the tiles above."""
    untiled = module.forward
    tile_forward = _tile_forward(cast(Callable[[torch.Tensor], torch.Tensor], module.act_fn), glu)

    def forward(x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // max(1, x.shape[-1])
        if not tiling.engages(tokens):
            return untiled(x)
        linears = [cast(nn.Linear, getattr(module, name)) for name in MLP_PROJECTIONS]
        params = [tensor for linear in linears for tensor in (linear.weight, linear.bias)]
        return tiled_gated_mlp(x, tiling.tile_tokens, tile_forward, params)

    return forward


def tile_mlps(root: nn.Module, config: Any, tiling: SeqTiling) -> list[str]:
    """Rebind the dense gated MLPs under ``root`` to run over tiles of ``tiling.tile_tokens`` tokens above a
    tile (see the module docstring); return their names. Call after ``fuse_modules``: below a tile the forward
    it left runs."""
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if activation is None:
        return []
    fused = importlib.util.find_spec("slide_kernels") is not None
    glu = GLU_ACTIVATIONS.get(str(activation)) if fused else None
    rebound = []
    for name, module in root.named_modules():
        if is_gated_mlp(module, str(activation)):
            module.forward = _tiling_forward(module, tiling, glu)
            rebound.append(name)
    return rebound


def tiling_of(model: Any) -> SeqTiling | None:
    """The model's :class:`SeqTiling` (the adapters' models have one), or None for a model that does not tile."""
    tiling = getattr(model, "seq_tiling", None)
    return tiling if isinstance(tiling, SeqTiling) else None


def use_seq_tile(model: Any, tile_tokens: int) -> None:
    """Run ``model``'s MLPs over tiles of ``tile_tokens`` tokens from now on (0: untiled); a model without
    tiling (not one of the adapters') is left as it is."""
    tiling = tiling_of(model)
    if tiling is not None:
        tiling.tile_tokens = tile_tokens
