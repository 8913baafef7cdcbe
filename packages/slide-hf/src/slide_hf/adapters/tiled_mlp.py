"""Dense gated MLPs run over tiles of tokens (slide_hf/adapters/token_tiles.py says why and how).

:func:`tile_mlps` rebinds the ``forward`` of every dense gated MLP under a unit's root, per instance, on top of
whatever :func:`~slide_hf.adapters.fused_modules.fuse_modules` left there: below a tile, that forward runs;
above, :class:`~slide_hf.adapters.token_tiles.TokenTilesFunction` over one tile's MLP at a time.

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
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from slide_hf.adapters.fused_modules import GLU_ACTIVATIONS, MLP_PROJECTIONS, is_gated_mlp, runs_fused
from slide_hf.adapters.token_tiles import SeqTiling, TileForward, run_over_tiles

__all__ = ["tile_mlps"]


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
        if not tiling.engages_for(x):
            return untiled(x)
        linears = [cast(nn.Linear, getattr(module, name)) for name in MLP_PROJECTIONS]
        params = [tensor for linear in linears for tensor in (linear.weight, linear.bias)]
        return run_over_tiles(x, tiling.tile_tokens, tile_forward, params)

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
