"""RMSNorms run over tiles of tokens (slide_hf/adapters/token_tiles.py says why and how).

Why the norms too: HF's RMSNorm code keeps its input and two fp32 (tokens x hidden) copies for autograd: at
131,072 tokens of Llama-3.1-8B, 5 GiB per norm, two norms per block (four in Gemma's), more than the rest of
the block once its MLP is tiled. Tiled, a norm keeps its input alone and recomputes one tile in the backward.

A tile computes what the module's own code computes, in the form read from that code (Note [Fused modules
are checked, not named] in fused_modules.py: ``w`` or ``1 + w``, the rounding before or after the weight):
slide-kernels' ``rms_norm`` on CUDA where it runs, as the untiled fused norm does, else the same formula in
torch (:func:`~slide_hf.adapters.fused_modules.norm_reference`, equal to the module's code in bf16 and fp32).
A norm whose form is neither is left untiled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from slide_hf.adapters.fused_modules import NormForm, is_rms_norm, norm_eps, norm_form, norm_reference, runs_fused
from slide_hf.adapters.token_tiles import SeqTiling, TileForward, run_over_tiles

__all__ = ["tile_norms"]


def _tile_forward(eps: float, form: NormForm) -> TileForward:
    """One tile of the norm, with ``form`` (read from the module's code) and ``eps`` fixed here."""
    offset, casting_mode = form

    def forward(x: torch.Tensor, params: Sequence[torch.Tensor | None]) -> torch.Tensor:
        weight = cast(torch.Tensor, params[0])
        if runs_fused(x):
            from slide_kernels import rms_norm

            return rms_norm(x, weight, eps, offset, casting_mode=casting_mode)
        return norm_reference(x, weight, eps, form)

    return forward


def _tiling_forward(module: nn.Module, tiling: SeqTiling, form: NormForm) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward: the one it had below a tile, the tiles above."""
    untiled = module.forward
    tile_forward = _tile_forward(norm_eps(module), form)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if not tiling.engages_for(hidden_states):
            return untiled(hidden_states)
        return run_over_tiles(hidden_states, tiling.tile_tokens, tile_forward, [cast(torch.Tensor, module.weight)])

    return forward


def tile_norms(root: nn.Module, tiling: SeqTiling, forms: dict[type, NormForm | None] | None = None) -> list[str]:
    """Rebind the RMSNorms under ``root`` whose form is known to run over tiles of ``tiling.tile_tokens`` rows
    above a tile; return their names. ``forms``: the norm forms already read, by class (one check per class
    per model, shared with ``fuse_modules``). Call after ``fuse_modules``: below a tile the forward it left
    runs."""
    forms = {} if forms is None else forms
    rebound = []
    for name, module in root.named_modules():
        if not is_rms_norm(module):
            continue
        if type(module) not in forms:
            forms[type(module)] = norm_form(module)
        form = forms[type(module)]
        if form is not None:
            module.forward = _tiling_forward(module, tiling, form)
            rebound.append(name)
    return rebound
