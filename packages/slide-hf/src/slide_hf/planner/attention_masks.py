"""The (S x S) attention masks a run builds, where its attention implementation needs one: GPU bytes that
grow with the square of the sequence, which no tiling removes.

Why: the attention itself never holds the (S x S) scores on a GPU (flash-attn, PyTorch's fused SDPA
kernels, flex attention: slide_hf/adapters/attention.py), but with ``sdpa`` HF's mask builders
(``transformers.masking_utils``, called per micro-batch by the adapters' ``prepare_inputs``,
slide_hf/adapters/base.py) hand PyTorch an explicit boolean (batch, 1, S, S) mask wherever SDPA's own
``is_causal`` cannot express it:

- sliding-window layers (Gemma 2 and 3, Mistral-style windows) once the sequence reaches the window
  (chunked layers likewise past their chunk);
- every layer of packed rows (several documents in one row, the default of `slide train`): attention must
  stop at each document's start.

One mask per layer type lives from the micro-batch's inputs to its last block's backward: ``batch x S x S``
bytes (bool). Each SDPA call with a boolean mask converts it to an additive bias in the compute dtype
(PyTorch does this before its memory-efficient kernel, which keeps the bias for its backward), so a block
holds ``batch x S x S x dtype`` more while it runs. At 131,072 tokens that is 16 GiB held plus 32 GiB per
call in bf16: no 8B run of that length fits a single GPU that way.

Flash-attn builds none (it reads the documents from the position ids, and applies windows in its kernel),
nor does flex attention (a block-sparse ``BlockMask``, a few MiB); so the remedy is flash-attn
(``pip install flash-attn``, CUDA with a bf16 or fp16 compute dtype), or, for a model without sliding
layers, ``--no-packing`` (one example per row: a causal mask SDPA needs no tensor for). The eager path
(capped layers on the CPU) builds an additive mask in the compute dtype, priced the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slide_hf.planner.inputs import PlanInputs

__all__ = ["AttentionMasks", "attention_masks"]

_SDPA, _EAGER = "sdpa", "eager"
_WINDOWED = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}
"""Layer types whose mask SDPA cannot skip once the sequence is longer than this config attribute."""
_RECURRENT = frozenset({"linear_attention"})


@dataclass(frozen=True)
class AttentionMasks:
    """The explicit masks a run's micro-batch builds, and their GPU bytes."""

    layers: tuple[tuple[str, str], ...] = ()
    """(layer type, attention implementation) of each layer type that builds a (S x S) mask."""
    held_bytes: int = 0
    """The masks, from the micro-batch's inputs to its last backward (persistent over the step)."""
    call_bytes: int = 0
    """What one attention call adds while its block runs: SDPA's additive copy of a boolean mask."""

    @property
    def any(self) -> bool:
        return bool(self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": {layer_type: implementation for layer_type, implementation in self.layers},
            "held_bytes": self.held_bytes,
            "call_bytes": self.call_bytes,
        }

    def remedy(self) -> str:
        """What removes the masks: flash-attn, and for packed full-attention layers --no-packing too."""
        windowed = any(layer_type in _WINDOWED for layer_type, _ in self.layers)
        fix = "install flash-attn (pip install flash-attn; CUDA, bf16), which builds no mask"
        return fix if windowed else f"{fix}, or train with --no-packing (one example per row)"


def attention_masks(inputs: PlanInputs) -> AttentionMasks:
    """The masks of ``inputs``' model on its planned device (a GPU where ``inputs.accelerator``, with what is
    installed here: plan on the machine that trains) at its sequence length, batch and packing."""
    model: Any = inputs.model
    config = getattr(model, "config", None)
    if not hasattr(model, "attention_for") or config is None:
        return AttentionMasks()  # a shape filled by hand or a model that is not an HF adapter's
    device_type = "cuda" if inputs.accelerator else "cpu"
    dtype = torch.bfloat16 if inputs.compute_dtype_bytes == 2 else torch.float32
    seq = inputs.seq_len
    layers = []
    for layer_type, implementation in model.attention_for(device_type, dtype).items():
        if layer_type in _RECURRENT:
            continue
        masked = inputs.packed_rows or _past_window(config, layer_type, seq)
        if implementation == _EAGER or (implementation == _SDPA and masked):
            layers.append((layer_type, implementation))
    square = inputs.batch_size * seq * seq
    d = inputs.compute_dtype_bytes
    held = sum(square * (d if implementation == _EAGER else 1) for _, implementation in layers)
    call = square * d if any(implementation == _SDPA for _, implementation in layers) else 0
    return AttentionMasks(tuple(layers), held, call)


def _past_window(config: Any, layer_type: str, seq_len: int) -> bool:
    """Whether ``layer_type`` restricts attention within a sequence of ``seq_len`` beyond causality (HF's
    config attribute of its window or chunk, read without touching the model's per-type configs)."""
    attribute = _WINDOWED.get(layer_type)
    window: Any = getattr(config, attribute, None) if attribute is not None else None
    return bool(window) and seq_len >= int(window)  # HF skips the mask only below the window
