"""Where HF's fused expert parameters sit in checkpoints that store one tensor per expert.

transformers 5 keeps a mixture-of-experts layer's experts fused in memory (``experts.gate_up_proj`` of
shape (experts, 2 * intermediate, hidden) and ``experts.down_proj`` of shape (experts, hidden,
intermediate)), while the Hub's checkpoints, and what ``save_pretrained`` writes, hold
``experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj`` one by one (the ``qwen2_moe`` conversion of
transformers' ``conversion_mapping.py``, shared by Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE and DeepSeek-V3).
:func:`split_experts` records that correspondence on a block unit as
:class:`~slide_hf.adapters.base.CheckpointSlice` entries, so loading and export stream each expert's
tensors with no conversion pass.
"""

from __future__ import annotations

from slide_hf.adapters.base import BlockUnit, CheckpointSlice

__all__ = ["split_experts"]


def split_experts(
    unit: BlockUnit, layer_prefix: str, num_experts: int, intermediate: int, experts: str = "mlp.experts"
) -> None:
    """Record the per-expert checkpoint keys of the fused experts at ``experts`` in ``unit`` (a layer stored
    under ``layer_prefix``, e.g. ``model.layers.3.``). A unit without them (a dense layer) is left alone."""
    gate_up, down = f"{experts}.gate_up_proj", f"{experts}.down_proj"
    if gate_up not in unit.layout:
        return
    stored = f"{layer_prefix}{experts}"
    halves = (("gate_proj", slice(0, intermediate)), ("up_proj", slice(intermediate, 2 * intermediate)))
    unit.checkpoint_slices[gate_up] = tuple(
        CheckpointSlice(f"{stored}.{e}.{proj}.weight", (e, rows)) for e in range(num_experts) for proj, rows in halves
    )
    unit.checkpoint_slices[down] = tuple(
        CheckpointSlice(f"{stored}.{e}.down_proj.weight", (e,)) for e in range(num_experts)
    )
