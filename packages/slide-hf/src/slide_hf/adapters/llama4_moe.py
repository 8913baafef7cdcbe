"""Llama 4's mixture of experts, each token through its own experts only.

transformers' ``Llama4TextMoe`` runs every token through every expert: it repeats the layer's input once
per expert, scales each copy by that expert's router score (zero where the router did not choose it) and
multiplies by the experts as one batched matmul. That is ``num_local_experts / num_experts_per_tok`` times
the routed work (16x on Llama 4 Scout), and the streamed MoE blocks of the acceptance matrix ran at 7-12 %
of the card's matmul rate. :func:`routed_experts_forward` computes the same layer from the chosen pairs
alone: the (token, expert) pairs sorted by expert, each expert's rows multiplied in one grouped matmul, the
outputs added back to their tokens.

It is the same arithmetic, not an approximation. The router, its scores (the input scaled by the sigmoid
of the chosen logit, in the input's dtype, before the experts, as Llama 4 does) and the shared expert are
HF's own modules. An unchosen expert's contribution in HF's form is an exact zero (its scaled input is
zero, and SiLU(0) x 0 is 0), so with one expert per token the output is HF's up to the matmul kernels'
rounding; with several, only the order of their sum differs. tests/hf/test_llama4_moe.py holds it to HF's
module, forward and backward, in fp32.
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["grouped_mm", "route_experts_by_token", "routed_experts_forward"]


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``rows`` (sorted by group) times ``weights[g]`` (groups, in, out) for each group's rows, which end at
    ``ends`` (int32, cumulative), differentiable. torch's grouped kernel where it runs: bf16 anywhere, fp32 on
    the CPU. Elsewhere (an fp32 or fp16 run on a GPU) one matmul per group, after one host sync for the group
    sizes; on meta tensors in those dtypes, one matmul of the output's shape (the planner measures what a
    block saves on meta, slide_hf/planner/activations.py, and no value is computed there)."""
    if _grouped_kernel_takes(rows, weights):
        if hasattr(F, "grouped_mm"):  # torch >= 2.10
            return F.grouped_mm(rows, weights, offs=ends)
        return torch._grouped_mm(rows, weights, offs=ends)
    if rows.device.type == "meta":
        return rows @ weights[0]
    starts = [0, *ends.tolist()]
    return torch.cat([rows[lo:hi] @ weights[g] for g, (lo, hi) in enumerate(itertools.pairwise(starts))])


def _grouped_kernel_takes(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether torch's grouped kernel multiplies these: bf16 (fp32 on the CPU), every stride a multiple of
    16 bytes and both operands 16-byte aligned (a real model's widths are; a tiny test model's may not be)."""
    dtype_runs = rows.dtype == torch.bfloat16 or (rows.device.type == "cpu" and rows.dtype == torch.float32)
    if not dtype_runs or weights.dtype != rows.dtype:
        return False
    for tensor in (rows, weights):
        size = tensor.element_size()
        strides = [stride for stride, extent in zip(tensor.stride(), tensor.shape, strict=True) if extent > 1]
        if any(stride * size % 16 for stride in strides if stride != 1):
            return False
        if tensor.device.type != "meta" and tensor.data_ptr() % 16:
            return False
    return True


def routed_experts_forward(moe: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Llama4TextMoe.forward`` from the chosen (token, expert) pairs alone; returns its output and the
    router's logits, as HF's does."""
    tokens_by_hidden = hidden_states.reshape(-1, moe.hidden_dim)
    scores, logits = moe.router(tokens_by_hidden)  # (tokens, experts): sigmoid of the chosen, 0 elsewhere
    chosen = torch.topk(logits, moe.top_k, dim=1).indices  # the router's own call on the same logits
    experts = chosen.reshape(-1)
    order = torch.argsort(experts, stable=True)
    token_of = order.div(moe.top_k, rounding_mode="floor")
    pair_scores = scores.gather(1, chosen).reshape(-1)[order]
    routed_in = tokens_by_hidden[token_of] * pair_scores.unsqueeze(1)
    # each expert's row count by a scatter, not bincount: its shape is known in advance, so the block runs
    # on meta tensors, where the planner measures what a block saves (slide_hf/planner/activations.py)
    counts = torch.zeros(moe.num_experts, dtype=torch.int64, device=experts.device)
    ends = counts.scatter_add_(0, experts, torch.ones_like(experts)).cumsum(0).to(torch.int32)
    gate, up = grouped_mm(routed_in, moe.experts.gate_up_proj, ends).chunk(2, dim=-1)
    routed_out = grouped_mm(up * moe.experts.act_fn(gate), moe.experts.down_proj, ends)
    out = moe.shared_expert(tokens_by_hidden)
    out.index_add_(0, token_of, routed_out.to(out.dtype))
    return out, logits


def route_experts_by_token(layer: nn.Module) -> None:
    """Give ``layer``'s mixture of experts (a Llama 4 decoder layer's ``feed_forward``, where it is one) the
    routed forward; a dense layer is left alone. Per instance: nothing global changes."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    moe = getattr(layer, "feed_forward", None)
    if isinstance(moe, Llama4TextMoe):
        moe.forward = types.MethodType(routed_experts_forward, moe)  # type: ignore[method-assign]
