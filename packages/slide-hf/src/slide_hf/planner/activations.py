"""Bytes autograd saves inside one decoder block, measured on the meta device.

Why measure instead of count: the engine recomputes one block's forward with grad and runs its backward
while that block's saved tensors are alive, so the GPU peak of a run follows what each family's code
actually keeps for autograd. A Llama-style count (9h + 2kv + 4i elements per token) misses most of it
for other families: transformers' torch path of a gated delta net (Qwen3.5, Qwen3-Next) saves about
three times that count, Gemma 3's extra norms and wide MLP 1.7 times. So the planner runs the first block
of each distinct kind of the model (its layer type and parameter layout) forward once on the ``meta``
device, where tensors have exact shapes and no storage (no memory, no compute: milliseconds), under
:func:`torch.autograd.graph.saved_tensors_hooks`, and adds up the distinct storages autograd keeps. The
block's parameters and inputs are left out: its input is one of the engine's activation buffers and
the rotary tables, masks and positions are side inputs, which the plan prices as such.

What each kind of block runs here (Note [Planning attention]):

- attention the engine runs through a fused kernel on the GPU (sdpa, flash-attn, Gemma 2's softcapped
  flex_attention): a planning attention function, registered with transformers' ``AttentionInterface``,
  whose autograd Function saves exactly what those kernels keep for their backward -- q, k, v, the
  output and an fp32 log-sum-exp of (batch, heads, seq) -- and returns an output of the right shape.
  Meta's own sdpa would take the math path and count the (seq x seq) probabilities, which no fused
  kernel keeps. For an sdpa layer it also follows transformers and PyTorch where they copy: k and v
  repeated over the query heads and a boolean mask turned into an additive bias in the compute dtype
  when a mask is given (sliding layers).
- attention the engine runs eagerly (an explicit ``eager``): transformers' eager function as it is,
  (seq x seq) scores and probabilities included.
- gated delta nets (``linear_attention`` layers): transformers' torch path, always: the model's
  :class:`~slide_hf.adapters.linear_attention.LinearAttention` binds its delta-net layers to the torch path
  on the meta device whatever transformers picked at import, so flash-linear-attention's Triton kernels
  are never launched on meta tensors (they would read address 0 and poison the process's CUDA context).
  That is the path a GPU run takes when fla is missing or refused; where fla runs, its fused kernels save
  less, so the plan is high there, never low (``test_linear_attention_blocks_are_priced_at_least_at_what_
  the_torch_path_saves`` checks the bound against a CPU run of the torch path).
- mixture-of-experts blocks: the engine runs transformers' ``grouped_mm`` experts (the adapters'
  default), which sort the routed tokens into shapes known in advance, so they run on meta too and are
  measured like the rest.
- a block whose forward cannot run on meta (a data-dependent shape, e.g. an experts loop over the
  experts that received tokens): measured as None, and the planner prices that block with its formula
  (``slide_hf.planner.memory._saved_elems_per_token``, top_k x moe_intermediate as an MoE's MLP width).
- slide-kernels' fused RMSNorm and SwiGLU run only on CUDA tensors; here the modules' own code runs,
  which saves a little more (the norms' fp32 copies), so the measurement bounds the fused run from above.

Batch: the tensors a block saves have the micro-batch as a dimension (the rotary tables, which do not,
are side inputs and left out), but for a few small ones (per head or per channel), so one sequence is
measured and the planner multiplies by the batch, which counts those few once per sequence: high by
under 1%, never low (``test_saved_bytes_scale_with_the_batch``), and ``largest_batch`` searches without a
measurement per batch. Sequence length is measured exactly: eager attention grows with its square.

Tiling (``--seq-tile``): the blocks' dense gated MLPs and RMSNorms run as slide_hf/adapters/token_tiles.py's
Function when a micro-batch is longer than a tile, which saves each module's input and nothing else.
``tiled=True`` measures the blocks that way (the model's :class:`~slide_hf.adapters.token_tiles.SeqTiling` set,
for the measurement only, to a tile the sequence exceeds: what the Function saves does not depend on the
tile); the planner adds one tile's share of the untiled modules' bytes to it (slide_hf/planner/seq_tiles.py).

Nothing here imports triton or touches a GPU: the blocks' fused modules take their CUDA path only for
CUDA tensors.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from slide_core.unit import SlideModel, Unit

__all__ = ["PLANNING_ATTENTION", "BlockActivations"]

log = logging.getLogger(__name__)

PLANNING_ATTENTION = "slide_planning"
"""The ``_attn_implementation`` under which blocks run while measured: fused-kernel saves, flash-attn and
flex_attention rules (k and v at their own heads, no mask copy)."""

_PLANNING_SDPA = "slide_planning_sdpa"
"""The same for layers the engine runs through sdpa, with its copies (repeated k and v, a mask bias)."""

_EAGER = "eager"


class FusedAttentionSaves(torch.autograd.Function):
    """What a fused attention kernel keeps for its backward, with shapes and no meaningful values.

    Forward returns the output in the kernels' (batch, seq, heads, v_dim) layout, which transformers
    reshapes into o_proj's input without a copy, so o_proj saves the same storage, as on the GPU. Run
    only by the planner, on meta tensors; the backward returns gradients of the right shapes so that an
    autograd graph built through it stays well formed.
    """

    @staticmethod
    def forward(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        batch, heads, seq, _ = query.shape
        out = query.new_empty((batch, seq, heads, value.shape[-1]))
        logsumexp = query.new_empty((batch, heads, seq), dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, logsumexp, bias)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value = ctx.saved_tensors[:3]
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), None


def planning_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    sdpa: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over :class:`FusedAttentionSaves` (Note [Planning
    attention]); ``sdpa`` adds the copies transformers' sdpa path and PyTorch make before the kernel."""
    bias = None
    if sdpa:
        from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa

        groups = int(getattr(module, "num_key_value_groups", 1))
        if groups > 1 and not use_gqa_in_sdpa(attention_mask, key, value):
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            bias = query.new_empty(attention_mask.shape)  # PyTorch's additive form of a boolean mask
    return FusedAttentionSaves.apply(query, key, value, bias), None


def _register_planning_attention() -> None:
    """Make the two planning names known to transformers (idempotent: the same functions every time)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PLANNING_ATTENTION, planning_attention)
    AttentionInterface.register(_PLANNING_SDPA, functools.partial(planning_attention, sdpa=True))


def _planning_name(engine_attention: str) -> str:
    """The implementation to measure under for what the engine runs on the GPU."""
    if engine_attention == _EAGER:
        return _EAGER
    return _PLANNING_SDPA if engine_attention == "sdpa" else PLANNING_ATTENTION


def _storages(value: Any) -> Iterator[int]:
    """Storage ids of every tensor in ``value`` (tensors, tuples, lists, dicts, dataclass-like objects)."""
    if isinstance(value, torch.Tensor):
        yield value.untyped_storage()._cdata
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _storages(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _storages(item)
    elif hasattr(value, "__dict__"):
        for item in vars(value).values():
            yield from _storages(item)


def _block_kind(block: Unit) -> tuple[Any, ...]:
    """Blocks of one kind save the same bytes: same layer type, same module class, same parameters."""
    root = getattr(block, "root", None)
    layout = tuple((spec.name, spec.shape) for spec in block.layout)
    return (getattr(block, "attention_type", None), type(root).__name__, layout)


class BlockActivations:
    """Measures, and caches per (sequence length, compute dtype), the bytes each kind of block of one
    model saves for autograd per sequence; see the module docstring for what runs and what is left out.

    Built by :meth:`of` for the adapters' models (HF decoder layers with a per-layer-type attention
    choice); any other model gets None and the planner's formula.
    """

    def __init__(self, model: SlideModel) -> None:
        self._model: Any = model  # an adapter's model: :meth:`of` checked it has their methods
        kinds: dict[tuple[Any, ...], Unit] = {}
        for block in model.blocks:
            kinds.setdefault(_block_kind(block), block)
        self._representatives = tuple(kinds.values())
        self._cache: dict[tuple[int, int, torch.dtype, bool], dict[str, int | None]] = {}

    @classmethod
    def of(cls, model: SlideModel) -> BlockActivations | None:
        """A measurer for ``model``, or None where its blocks are not the adapters' HF layers."""
        if not model.blocks or not all(hasattr(model, name) for name in ("attention_for", "attention_config")):
            return None
        return cls(model)

    def saved_bytes(
        self, seq_len: int, dtype: torch.dtype, *, batch: int = 1, tiled: bool = False
    ) -> dict[str, int | None]:
        """``{block name: bytes saved for a micro-batch of batch x seq_len tokens}`` for the first block
        of each kind; None for a kind whose forward cannot run on meta. The planner asks for one
        sequence and multiplies (see the module docstring). ``tiled``: with the MLPs run over tiles."""
        key = (batch, seq_len, dtype, tiled)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._measure_tiled(batch, seq_len, dtype, tiled)
        return dict(found)

    @property
    def tiles(self) -> bool:
        """Whether any block of the model has an MLP that runs over tiles of tokens."""
        return any(getattr(block, "tiled_modules", ()) for block in self._model.blocks)

    def _measure_tiled(self, batch: int, seq_len: int, dtype: torch.dtype, tiled: bool) -> dict[str, int | None]:
        from slide_hf.adapters.token_tiles import tiling_of

        tiling = tiling_of(self._model)
        if tiling is None:
            return self._measure(batch, seq_len, dtype)
        kept = tiling.tile_tokens
        tiling.tile_tokens = max(1, (batch * seq_len + 1) // 2) if tiled else 0  # two tiles, or none
        try:
            return self._measure(batch, seq_len, dtype)
        finally:
            tiling.tile_tokens = kept

    def _measure(self, batch: int, seq_len: int, dtype: torch.dtype) -> dict[str, int | None]:
        model = self._model
        meta = torch.device("meta")
        ids = torch.zeros((batch, seq_len), dtype=torch.long, device=meta)
        inputs = model.prepare_inputs(ids, ids, dtype)
        engine = model.attention_for("cuda", dtype)  # what the engine runs on the GPU (Note [Planning attention])
        _register_planning_attention()
        configs = {}
        for block in self._representatives:
            kind = getattr(block, "attention_type", None)
            if kind in engine and kind not in configs:
                configs[kind] = model.attention_config(kind, meta.type, dtype)
        chosen = {kind: config._attn_implementation for kind, config in configs.items()}
        try:
            for kind, config in configs.items():
                config._attn_implementation = _planning_name(engine[kind])
            shape = (batch, seq_len)
            return {block.name: self._measure_block(block, inputs, shape, dtype) for block in self._representatives}
        finally:
            for kind, config in configs.items():
                config._attn_implementation = chosen[kind]

    def _measure_block(self, block: Unit, inputs: Any, tokens: tuple[int, int], dtype: torch.dtype) -> int | None:
        """Bytes one sequence saves in ``block``. An experts module that cannot run on meta (transformers'
        eager loop over the experts that received tokens) is run as a stand-in that saves nothing and
        priced by :func:`_routed_experts_elems_per_token` instead; None where another part fails."""
        failing: list[str] = []
        try:
            return self._saved_by(block, inputs, tokens, dtype, failing=failing)
        except Exception as error:  # a data-dependent shape somewhere in the block
            part = failing[-1] if failing else None
            log.debug("%s: %s cannot run on the meta device (%s)", block.name, part, type(error).__name__)
        routed = _routed_experts_elems_per_token(self._model.config)
        if part is None or routed is None or not part.endswith("experts"):
            return None
        try:
            measured = self._saved_by(block, inputs, tokens, dtype, stand_in=part)
        except Exception as error:
            log.debug("%s cannot run on the meta device without %s (%s)", block.name, part, type(error).__name__)
            return None
        return measured + tokens[0] * tokens[1] * routed * dtype.itemsize

    def _saved_by(
        self,
        block: Unit,
        inputs: Any,
        tokens: tuple[int, int],
        dtype: torch.dtype,
        *,
        failing: list[str] | None = None,
        stand_in: str | None = None,
    ) -> int:
        """Run ``block`` forward on meta for ``tokens`` (batch, seq); ``failing`` collects the submodules entered and
        not left (the innermost one running when an error is raised is last), ``stand_in`` names one run
        as :class:`_StandIn` instead."""
        meta = torch.device("meta")
        params = {
            spec.name: torch.empty(spec.shape, dtype=dtype, device=meta, requires_grad=True) for spec in block.layout
        }
        width = self._model.activation_width() or int(self._model.config.hidden_size)
        x = torch.empty((*tokens, width), dtype=dtype, device=meta, requires_grad=True)
        excluded = {*_storages(params), *_storages(x), *_storages(inputs)}
        saved: dict[int, int] = {}
        held: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage._cdata not in excluded:
                saved[storage._cdata] = storage.nbytes()
                held.append(tensor)  # alive to the end, so no storage id is freed and reused meanwhile
            return tensor

        root: torch.nn.Module = block.root  # type: ignore[attr-defined]
        handles = []
        if failing is not None:
            for name, child in root.named_modules():
                if not name:
                    continue
                handles.append(child.register_forward_pre_hook(functools.partial(_entered, failing, name)))
                handles.append(child.register_forward_hook(functools.partial(_left, failing, name)))
        replaced = root.get_submodule(stand_in) if stand_in else None
        own_forward = replaced.__dict__.get("forward") if replaced is not None else None
        if replaced is not None:
            replaced.forward = _stand_in_forward
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out = block.forward(params, x, inputs)
            del out
            return sum(saved.values())
        finally:
            for handle in handles:
                handle.remove()
            if replaced is not None:
                if own_forward is None:
                    del replaced.forward
                else:
                    replaced.forward = own_forward


def _entered(stack: list[str], name: str, module: torch.nn.Module, args: Any) -> None:
    stack.append(name)


def _left(stack: list[str], name: str, module: torch.nn.Module, args: Any, output: Any) -> None:
    stack.remove(name)


class _StandIn(torch.autograd.Function):
    """A submodule's place in the graph: the output shape of its input, nothing saved."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(grad)


def _stand_in_forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return _StandIn.apply(hidden_states)


def _routed_experts_elems_per_token(config: Any) -> int | None:
    """Elements per token that transformers' eager experts loop saves (the router and shared experts
    around it run on meta), or None for a config without routed experts.

    Per (token, chosen expert): the gathered input (h) for the gate/up projection, its (2 x moe
    intermediate) output for the activation and the product, the activation (mi) and the product (mi)
    for the down projection, two more h-wide tensors around the multiply by the fp32 routing weight and
    the cast back, and the int64 token and slot indices and the gathered weight (10 compute-dtype
    elements): 3h + 4mi + 10, top_k times (checked against a CPU run by
    ``test_experts_loop_priced_like_a_cpu_run``).
    """
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k_experts", None)
    width = getattr(config, "moe_intermediate_size", None)
    if not top_k or not width:
        return None
    return int(top_k) * (3 * int(config.hidden_size) + 4 * int(width) + 10)
