"""Defaults that depend on the model or the data, decided in one place.

``seq_len`` left unset (``None``, the default of every way in: `slide train`, `slide data`, `slide plan`,
`slide bench`, a TOML file, ``slide_hf.train``) means :func:`resolve_seq_len`: 2048 tokens, or the
model's context length when that is shorter, so one model gets one row length whichever command asks.

The demo run (no ``--data``: the bundled English text, a few thousand bytes) has defaults of its own so
``slide train`` with no arguments learns visibly in seconds on a CPU: rows of :data:`DEMO_SEQ_LEN` tokens
(at 2048, the whole text would be three rows) and :data:`DEMO_EPOCHS` passes over it.

``seq_tile`` left unset (``--seq-tile auto``) is chosen by the planner where the run has a GPU budget: the
largest tile whose priced GPU peak fits it (slide_hf/planner/auto_tile.py's :func:`auto_seq_tile`, which `slide
plan` and `slide train` both call through slide_hf/setup.py's ``plan_inputs``); without a budget (the CPU
device) it is :func:`resolve_seq_tile`: tiles of :data:`DEFAULT_SEQ_TILE` tokens for rows longer than that,
untiled below (slide_hf/adapters/token_tiles.py).
"""

from __future__ import annotations

from typing import Any

from slide_hf.errors import UserError

__all__ = [
    "AUTO_SEQ_TILE_FLOOR",
    "AUTO_SEQ_TILE_MIN",
    "DEFAULT_SEQ_LEN",
    "DEFAULT_SEQ_TILE",
    "DEMO_EPOCHS",
    "DEMO_SEQ_LEN",
    "check_seq_tile",
    "model_positions",
    "resolve_seq_len",
    "resolve_seq_tile",
]

DEFAULT_SEQ_LEN = 2048
DEFAULT_SEQ_TILE = 8192
"""Tokens per MLP tile when ``--seq-tile`` is not given: large enough that each tile's matmuls run at full
rate on a GPU (thousands of rows), small enough that a tile's intermediates of an 8B model (8192 x 14336 in
bf16: 224 MiB each) are a small part of its GPU budget."""
AUTO_SEQ_TILE_FLOOR = 1024
"""The smallest tile ``--seq-tile auto`` takes while a larger one fits: below about a thousand rows a tile's
matmuls stop filling a GPU and the per-tile launches start to show, for little memory (the tile's share of
the MLP intermediates is already small next to the tiling's own buffers)."""
AUTO_SEQ_TILE_MIN = 256
"""The smallest tile ``--seq-tile auto`` tries at all, only where nothing from :data:`AUTO_SEQ_TILE_FLOOR` up fits."""
DEMO_SEQ_LEN = 128
DEMO_EPOCHS = 3


def model_positions(config: Any) -> int | None:
    """The model's context length from its HF config (``max_position_embeddings``, GPT-2's ``n_positions``)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def resolve_seq_len(seq_len: int | None, config: Any, *, bundled_text: bool = False) -> int:
    """``seq_len`` when given; else :data:`DEMO_SEQ_LEN` for the bundled text, else :data:`DEFAULT_SEQ_LEN`,
    either capped at the model's context length."""
    if seq_len is not None:
        return seq_len
    default = DEMO_SEQ_LEN if bundled_text else DEFAULT_SEQ_LEN
    positions = model_positions(config)
    return min(default, positions) if positions else default


def resolve_seq_tile(seq_tile: int | None, seq_len: int) -> int:
    """``seq_tile`` when given (0: off); else :data:`DEFAULT_SEQ_TILE` for rows longer than it, else 0. Rows of
    the default length and batches of them stay untiled: tiling adds one more MLP forward to each block's
    backward, which only pays where the untiled intermediates would crowd the GPU."""
    if seq_tile is not None:
        return seq_tile
    return DEFAULT_SEQ_TILE if seq_len > DEFAULT_SEQ_TILE else 0


def check_seq_tile(seq_tile: int | None, batch_size: int, seq_len: int) -> None:
    """Refuse a given tile that no micro-batch of the run exceeds: it would never tile, which a user who asked
    for tiles (a long ``--seq-len`` in mind) should hear before the run is sized without them."""
    tokens = batch_size * seq_len
    if seq_tile is not None and seq_tile >= tokens > 0 and seq_tile > 0:
        raise UserError(
            f"--seq-tile {seq_tile} is not below the {tokens} tokens of a micro-batch (--batch-size {batch_size} "
            f"x --seq-len {seq_len}), so nothing would be tiled; give a smaller tile, auto, or 0 for off"
        )
