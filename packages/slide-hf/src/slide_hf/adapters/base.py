"""The generic HF adapter: units that run Hugging Face's own submodules on explicitly bound weights.

Why wrap HF modules instead of re-implementing each family: the math (attention variants, softcapping,
sandwich norms, rotary flavours, MoE routing) stays exactly HF's, so a checkpoint trained here behaves
the same in ``transformers`` and new families cost a few lines. The modules are instantiated on the
``meta`` device, so they hold no storage; every call binds the engine's views (bf16 on the GPU, fp32 in
tests) with :func:`torch.func.functional_call`. That is the explicit binding the engine wants: no
``param.data`` swapping, and the autograd graph is rooted at the engine's own leaf tensors.

A family (see ``llama.py``) subclasses :class:`HFCausalLM` and names its HF classes; everything else --
unit layouts, checkpoint key mapping, side inputs (positions, rotary tables, masks through
``transformers.masking_utils``), the fused LM-head loss -- lives here.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from transformers import PreTrainedConfig
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_recurrent_attention_mask,
    create_sliding_window_causal_mask,
    packed_sequence_mask_function,
)

from slide_core.unit import ParamLayout, SlideModel, Unit, UnitRole
from slide_hf.adapters.attention import AttentionSupport, choose_attention, layer_attention, requested_attention
from slide_hf.adapters.fused_modules import NormForm, fuse_modules
from slide_hf.adapters.linear_attention import LinearAttention
from slide_hf.adapters.tiled_mlp import tile_mlps
from slide_hf.adapters.tiled_norm import tile_norms
from slide_hf.adapters.token_tiles import SeqTiling
from slide_hf.errors import UserError
from slide_hf.preference.head import PreferenceHead
from slide_hf.preference.tags import pair_count

__all__ = [
    "IGNORE_INDEX",
    "RECURRENT_LAYER_TYPES",
    "BlockUnit",
    "BufferFactory",
    "CheckpointSlice",
    "EmbeddingUnit",
    "HFCausalLM",
    "HFInputs",
    "HFUnit",
    "HeadUnit",
    "causal_lm_loss_sum",
    "refuse_packing",
]

IGNORE_INDEX = -100

BufferFactory = Callable[[], torch.Tensor]

_MASK_BUILDERS: dict[str, Callable[..., Any]] = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
    "chunked_attention": create_chunked_causal_mask,
    "linear_attention": create_recurrent_attention_mask,
}
"""HF layer type -> the ``masking_utils`` builder HF itself uses for it (sdpa/eager/flex/flash aware)."""

RECURRENT_LAYER_TYPES = frozenset({"linear_attention"})
"""Layer types without attention (Qwen3-Next's gated delta nets): HF's recurrent mask (None without
padding), no attention implementation to choose, and no way to keep packed documents apart -- HF's
torch path carries the recurrent state and the causal convolution across the whole row."""


def refuse_packing(model: Any, *, packing: bool) -> None:
    """Refuse in one line packed rows for a model with recurrent layers (``RECURRENT_LAYER_TYPES``): its
    state would flow from one packed document into the next. `slide plan` and `slide train` call it as soon
    as the model is built, before any data is read or any plan is shown as fitting; the forward of packed
    rows calls it too, for a caller of the engine that skipped both."""
    if not packing:
        return
    recurrent = sorted({block.attention_type for block in model.blocks} & RECURRENT_LAYER_TYPES)
    if recurrent:
        raise UserError(
            f"{model.config.model_type} has {', '.join(recurrent)} layers, whose recurrent state would flow "
            "from one packed document into the next; train with --no-packing (one example per row)"
        )


@dataclass(frozen=True)
class CheckpointSlice:
    """Part of a unit parameter stored under its own key on disk.

    HF keeps some fused parameters split in checkpoints (Qwen3-MoE experts: one ``gate_proj`` /
    ``up_proj`` / ``down_proj`` per expert on disk, one 3-d ``gate_up_proj`` in memory). The loader copies
    tensor ``key`` into ``view[index]``; the exporter writes ``view[index]`` as ``key``.
    """

    key: str
    index: tuple[Any, ...] = ()
    source: tuple[slice, ...] = ()
    """The region of the stored tensor this piece is, where a unit holds only part of a checkpoint tensor
    (Gemma 4's per-layer embedding table is one (vocab, layers x width) tensor on disk and each block's
    (vocab, width) columns in memory); empty for the whole tensor. Several units' pieces make up the
    stored tensor: the loader copies ``stored[source]`` into ``view[index]``, the exporter assembles."""
    stored_shape: tuple[int, ...] = ()
    """The whole stored tensor's shape, given with ``source``: what the loader checks the file against and
    the shape the exporter writes."""


@dataclass
class HFInputs:
    """Side inputs of one micro-batch, built once by :meth:`HFCausalLM.prepare_inputs`.

    ``masks`` is keyed by HF layer type (``"full_attention"``, ``"sliding_attention"``); a value may be
    ``None`` where HF's mask builder decided none is needed (sdpa's ``is_causal`` path).
    """

    position_ids: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    masks: dict[str, torch.Tensor | None]
    shift_labels: torch.Tensor

    def layer_kwargs(self, attention_type: str) -> dict[str, Any]:
        """Every keyword an HF decoder layer may want; :class:`BlockUnit` keeps the ones it accepts."""
        return {
            "attention_mask": self.masks[attention_type],
            "position_ids": self.position_ids,
            "position_embeddings": self.position_embeddings,
            "past_key_values": None,
            "use_cache": False,
        }


class HFUnit(Unit):
    """A unit whose parameters are those of ``root``, a meta-device module tree of HF submodules.

    Note [Buffers carried as parameters]: a few HF modules keep checkpoint state that is not trained in a
    persistent buffer (DeepSeek-V3's ``e_score_correction_bias``). Such a value must travel wherever the
    weights travel -- loading, run checkpoints, ``slide export`` of a run, HF export -- and all of those
    move the unit's layout (the fp32 slab), so the adapter turns the buffer into a layout entry and names
    it in ``buffer_params``. It gets no gradient (it only selects, never weighs), and AdamW leaves a 1-d
    entry with no gradient exactly as it was; :func:`~slide_hf.model.param_count` does not count it, as
    HF does not.

    Parameter names are the submodules' own names (``self_attn.q_proj.weight``). ``checkpoint_names``
    maps each to its key in the HF model's state dict; ``checkpoint_slices`` overrides that for parameters
    split across several keys on disk. ``buffers`` supplies real values for the few buffers HF modules keep
    (a meta buffer has no value); they are tiny and cached per device.
    """

    def __init__(
        self,
        name: str,
        role: UnitRole,
        root: nn.Module,
        *,
        checkpoint_prefix: str,
        extra_params: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
        buffers: Mapping[str, BufferFactory] | None = None,
    ) -> None:
        root.eval()  # no dropout: the engine may recompute a unit in backward, which must be deterministic
        shapes: list[tuple[str, Sequence[int]]] = [(n, tuple(p.shape)) for n, p in root.named_parameters()]
        extra = dict(extra_params or {})
        shapes += [(n, shape) for n, (shape, _) in extra.items()]
        super().__init__(name, role, ParamLayout(shapes))
        self.root = root
        self.checkpoint_names: dict[str, str] = {n: checkpoint_prefix + n for n, _ in root.named_parameters()}
        self.checkpoint_names.update({n: key for n, (_, key) in extra.items()})
        self.checkpoint_slices: dict[str, tuple[CheckpointSlice, ...]] = {}
        factories = dict(buffers or {})
        missing = [n for n, _ in root.named_buffers() if n not in factories]
        if missing:
            raise TypeError(f"{name}: the adapter gives no value for HF buffers {missing}")
        self._buffer_factories = factories
        self._buffers: dict[torch.device, dict[str, torch.Tensor]] = {}
        self.fused_modules: list[str] = []
        """Submodules whose forward runs slide-kernels' fused ops on CUDA (see fused_modules.py)."""
        self.tiled_modules: list[str] = []
        """Submodules whose forward runs over tiles of tokens above the model's tile (see token_tiles.py)."""
        self.buffer_params: frozenset[str] = frozenset()
        """Layout entries that HF keeps as persistent buffers (Note [Buffers carried as parameters])."""

    def buffers_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        found = self._buffers.get(device)
        if found is None:
            found = {n: make().to(device) for n, make in self._buffer_factories.items()}
            self._buffers[device] = found
        return found

    def call(self, path: str, params: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """Run submodule ``path`` of ``root`` ("" for root itself) on the bound ``params``."""
        module = self.root.get_submodule(path) if path else self.root
        prefix = f"{path}." if path else ""
        bound = {n[len(prefix) :]: t for n, t in params.items() if n.startswith(prefix) and n in self.layout}
        if self._buffer_factories:
            device = args[0].device
            bound.update({n[len(prefix) :]: t for n, t in self.buffers_on(device).items() if n.startswith(prefix)})
        return functional_call(module, bound, args, kwargs)


class EmbeddingUnit(HFUnit):
    """Token ids (B, S) -> hidden (B, S, H) through the family's embedding module (``root.<embed_name>``)."""

    def __init__(self, root: nn.Module, embed_name: str, **kwargs: Any) -> None:
        super().__init__("embedding", UnitRole.EMBEDDING, root, **kwargs)
        self.embed_name = embed_name

    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs: HFInputs) -> torch.Tensor:
        return self.call(self.embed_name, params, x)


class BlockUnit(HFUnit):
    """One HF decoder layer: hidden -> hidden.

    Only the keywords the layer's ``forward`` names are passed (HF layers differ: GPT-2 takes no rotary
    embeddings, Gemma2 no ``use_cache``); unnamed ones would leak into the attention kernel's ``**kwargs``.
    """

    def __init__(self, index: int, layer: nn.Module, attention_type: str, **kwargs: Any) -> None:
        super().__init__(f"block.{index}", UnitRole.BLOCK, layer, **kwargs)
        self.index = index
        self.attention_type = attention_type
        self._accepts = _named_parameters_of(type(layer).forward)

    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs: HFInputs) -> torch.Tensor:
        kwargs = {k: v for k, v in inputs.layer_kwargs(self.attention_type).items() if k in self._accepts}
        out = self.call("", params, x, **kwargs)
        return out[0] if isinstance(out, tuple) else out  # transformers 5 layers return tensors; older: tuples


class HeadUnit(HFUnit):
    """Final norm + LM head + loss: hidden -> the sum of per-token cross-entropy over label tokens."""

    def __init__(
        self, root: nn.Module, norm_name: str, lm_head_name: str, softcap: float | None, **kwargs: Any
    ) -> None:
        super().__init__("head", UnitRole.HEAD, root, **kwargs)
        self.norm_name = norm_name
        self.lm_head_name = lm_head_name
        self.softcap = softcap
        self.preference: PreferenceHead | None = None
        """A preference objective's loss (``--objective dpo|simpo``, slide_hf/preference/head.py) instead of
        the token cross-entropy; None for SFT."""

    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs: HFInputs) -> torch.Tensor:
        return self.forward_into(params, x, inputs, {})

    @property
    def grads_in_forward(self) -> frozenset[str]:
        """The LM head matrix, when slide-kernels' fused loss (which makes its gradient in the forward)
        is installed."""
        return frozenset({self.lm_head_name}) if _fused_linear_cross_entropy() is not None else frozenset()

    def forward_into(
        self,
        params: Mapping[str, torch.Tensor],
        x: torch.Tensor,
        inputs: HFInputs,
        grad_into: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        hidden = self.call(self.norm_name, params, x)
        return self.loss_of(hidden, params[self.lm_head_name], inputs, grad_into.get(self.lm_head_name))

    def loss_of(
        self, hidden: torch.Tensor, weight: torch.Tensor, inputs: HFInputs, grad_weight_out: torch.Tensor | None
    ) -> torch.Tensor:
        """The head's loss on its final hidden state: the summed token cross-entropy, or with a preference
        objective the summed pair losses (Note [Preference loss through a weighted cross-entropy])."""
        if self.preference is not None:
            return self.preference.loss_sum(
                hidden, weight, inputs.shift_labels, softcap=self.softcap, grad_weight_out=grad_weight_out
            )
        return causal_lm_loss_sum(
            hidden, weight, inputs.shift_labels, softcap=self.softcap, grad_weight_out=grad_weight_out
        )


@functools.cache
def _fused_linear_cross_entropy() -> Callable[..., torch.Tensor] | None:
    # Resolved on first use, not at import: slide_kernels may pull in triton, which `import slide_hf` must not.
    try:
        import slide_kernels

        return slide_kernels.linear_cross_entropy
    except (ImportError, AttributeError):
        return None


def causal_lm_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    softcap: float | None = None,
    grad_weight_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of token cross-entropies (fp32, 0-dim) of ``hidden @ weight.T`` against shifted labels.

    Uses slide-kernels' fused linear + cross-entropy when installed (the (tokens, vocab) logits never exist
    in full, and ``weight``'s gradient goes into ``grad_weight_out`` when given); otherwise HF's own
    recipe: logits in the compute dtype, softcap, upcast to fp32, then CE (``grad_weight_out`` unused).
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    labels = shift_labels.reshape(-1)
    fused = _fused_linear_cross_entropy()
    if fused is not None:
        loss = fused(
            h, weight, labels, bias=None, ignore_index=IGNORE_INDEX, reduction="sum", softcap=softcap,
            grad_weight_out=grad_weight_out,
        )  # fmt: skip
        return loss.float()
    logits = F.linear(h, weight)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


class HFCausalLM(SlideModel):
    """A Hugging Face causal LM as a :class:`SlideModel`.

    A family sets the class attributes below (HF classes and state-dict names) and overrides a ``make_*``
    hook only where it differs from Llama. The config is copied: the HF modules read
    ``config._attn_implementation`` at call time, and choosing it must not touch the caller's. Each layer
    type gets a copy of its own, which its blocks' HF modules and its mask builder read, so each type
    runs the attention chosen for it (:meth:`attention_for`).
    """

    embedding: EmbeddingUnit
    blocks: list[BlockUnit]
    head: HeadUnit
    decoder_layer: ClassVar[type[nn.Module]]
    """HF decoder layer class, called as ``decoder_layer(config, layer_idx)``."""
    rotary_embedding: ClassVar[type[nn.Module] | None] = None
    """HF rotary embedding class (has buffers, so it is built for real, per device); None: no rotary."""
    base_prefix: ClassVar[str] = "model."
    """State-dict prefix of the base model (``model.``; GPT-2: ``transformer.``)."""
    layers_name: ClassVar[str] = "layers"
    embed_name: ClassVar[str] = "embed_tokens"
    norm_name: ClassVar[str] = "norm"
    lm_head_key: ClassVar[str] = "lm_head.weight"
    norm_init: ClassVar[float] = 1.0
    """Initial value of norm weights: 1 for ``w * x``; Gemma's zero-centred ``(1 + w) * x`` wants 0."""

    def __init__(self, config: PreTrainedConfig) -> None:
        self.config = _runtime_config(config)
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False))
        with torch.device("meta"):
            self.embedding = self.make_embedding_unit()
            self.blocks = [self.make_block_unit(i) for i in range(self.config.num_hidden_layers)]
            self.head = self.make_head_unit()
        norm_forms: dict[type, NormForm | None] = {}
        for unit in (*self.blocks, self.head):
            unit.fused_modules = fuse_modules(unit.root, self.config, norm_forms)
        self.seq_tiling = SeqTiling()
        """Tokens per tile of the blocks' MLPs and norms, 0 (off) until a run or a plan sets it (``--seq-tile``,
        token_tiles.py)."""
        for block in self.blocks:
            mlps = tile_mlps(block.root, self.config, self.seq_tiling)
            block.tiled_modules = mlps + tile_norms(block.root, self.seq_tiling, norm_forms)
        unknown = {b.attention_type for b in self.blocks} - set(_MASK_BUILDERS)
        if unknown:
            raise ValueError(f"{self.config.model_type}: unsupported attention layer types {sorted(unknown)}")
        self._rotary: dict[torch.device, nn.Module] = {}
        self._init_attention()
        self.linear_attention = LinearAttention.for_layers(b.root for b in self.blocks)
        """The delta-rule implementation each device runs (adapters/linear_attention.py); None without
        delta-net layers."""

    # ---- family hooks -------------------------------------------------------------------------------
    def make_embedding(self) -> nn.Module:
        c = self.config
        return nn.Embedding(c.vocab_size, c.hidden_size, getattr(c, "pad_token_id", None))

    def make_norm(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must define make_norm()")

    def make_layer(self, index: int) -> nn.Module:
        return self.decoder_layer(self.config, index)

    def attention_type(self, index: int) -> str:
        """HF's choice of mask for layer ``index``: ``config.layer_types`` where the family has it,
        else sliding when ``config.sliding_window`` is set (Mistral, Phi-3, Qwen3-MoE)."""
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types:
            return layer_types[index]
        return "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"

    def embedding_buffers(self) -> dict[str, BufferFactory]:
        return {}

    def make_embedding_unit(self) -> EmbeddingUnit:
        root = nn.Module()
        root.add_module(self.embed_name, self.make_embedding())
        return EmbeddingUnit(
            root, self.embed_name, checkpoint_prefix=self.base_prefix, buffers=self.embedding_buffers()
        )

    def make_block_unit(self, index: int) -> BlockUnit:
        prefix = f"{self.base_prefix}{self.layers_name}.{index}."
        return BlockUnit(index, self.make_layer(index), self.attention_type(index), checkpoint_prefix=prefix)

    def make_head_unit(self) -> HeadUnit:
        return self.build_head_unit(HeadUnit)

    def build_head_unit(self, unit_class: type[HeadUnit], **options: Any) -> HeadUnit:
        """The final norm and the tied or own head matrix as ``unit_class`` (``options`` are its own
        keywords): one place for the head's parameters, whichever head class a family computes with."""
        c = self.config
        root = nn.Module()
        root.add_module(self.norm_name, self.make_norm())
        lm_head = "lm_head.weight"
        extra = {} if self.tied else {lm_head: ((c.vocab_size, c.hidden_size), self.lm_head_key)}
        head = unit_class(
            root,
            self.norm_name,
            lm_head,
            getattr(c, "final_logit_softcapping", None),
            checkpoint_prefix=self.base_prefix,
            extra_params=extra,
            **options,
        )
        if self.tied:
            head.borrowed = {lm_head: self.token_embedding_param}
        return head

    @property
    def token_embedding_param(self) -> str:
        """The embedding unit's (vocab, hidden) matrix; a tied head borrows it."""
        return f"{self.embed_name}.weight"

    def padding_row(self) -> tuple[str, int] | None:
        """``(param, row)`` of the token embedding that HF keeps at zero (``padding_idx``), if any."""
        module = self.embedding.root.get_submodule(self.embed_name)
        index = getattr(module, "padding_idx", None)
        return None if index is None else (self.token_embedding_param, int(index))

    def init_rule(self, unit: Unit, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
        """HF-style initial value of a parameter: ``("normal", std)`` or ``("constant", value)``."""
        if len(shape) >= 2:
            return "normal", float(self.config.initializer_range)
        if name.endswith("bias"):
            return "constant", 0.0
        return "constant", self.norm_init

    # ---- attention ----------------------------------------------------------------------------------
    def _init_attention(self) -> None:
        """One config copy per layer type, read by that type's blocks (their HF modules were built on
        ``self.config``), and the user's explicit choice, checked once (a refusal is one line)."""
        layer_types = list(dict.fromkeys(b.attention_type for b in self.blocks))
        self._requested_attention = requested_attention(self.config, layer_types)
        self._layer_configs = {t: copy.deepcopy(self.config) for t in layer_types}
        for block in self.blocks:
            _repoint_config(block.root, self.config, self._layer_configs[block.attention_type])
        self._attention: dict[tuple[str, torch.dtype, str], str] = {}
        self._device_attention: str | None = None

    def prefer_attention(self, implementation: str | None) -> None:
        """The run's device's preferred attention (``Device.preferred_attention``), tried before the
        rule for every layer that can run it (a user's explicit choice still wins). Forgets the choices
        made so far, so the next micro-batch and the next log follow it."""
        self._device_attention = implementation
        self._attention.clear()

    def attention_for(self, device_type: str, dtype: torch.dtype) -> dict[str, str]:
        """``{layer type: HF attention implementation}`` on ``device_type`` at compute ``dtype``.

        Decided on first use for each (device type, dtype, layer type) by the rule in
        :mod:`slide_hf.adapters.attention` (or the user's explicit ``config._attn_implementation``) and
        cached on this instance, not per process: one model object may run on the CPU in a test and on a
        GPU in the same process. Layer types come in model order.
        """
        return {
            t: self._attention_of(t, device_type, dtype) for t in self._layer_configs if t not in RECURRENT_LAYER_TYPES
        }

    def attention_config(self, layer_type: str, device_type: str, dtype: torch.dtype) -> PreTrainedConfig:
        """The config that ``layer_type``'s HF modules and mask builder read, set to the attention chosen
        for this device and dtype. :meth:`prepare_inputs` calls it for every micro-batch, before any block
        runs on that micro-batch, so a model moved between devices follows (one attribute store)."""
        config = self._layer_configs.get(layer_type)
        if config is None:  # a block's type changed after building (a test comparing masks does this)
            config = self._layer_configs[layer_type] = copy.deepcopy(self.config)
        config._attn_implementation = self._attention_of(layer_type, device_type, dtype)
        return config

    def attention_support(self, device_type: str, dtype: torch.dtype) -> AttentionSupport:
        """What ``device_type`` offers this family at ``dtype``: what is installed, less what the family's HF
        code cannot use (Llama 4 has no flash-attention path)."""
        return AttentionSupport.detect(device_type, dtype)

    def _attention_of(self, layer_type: str, device_type: str, dtype: torch.dtype) -> str:
        key = (device_type, dtype, layer_type)
        found = self._attention.get(key)
        if found is None:
            support = dataclasses.replace(self.attention_support(device_type, dtype), preferred=self._device_attention)
            found = self._requested_attention or choose_attention(layer_attention(self.config, layer_type), support)
            self._attention[key] = found
        return found

    # ---- side inputs --------------------------------------------------------------------------------
    def prepare_inputs(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        dtype: torch.dtype,
        *,
        position_ids: torch.Tensor | None = None,
    ) -> HFInputs:
        """Positions, rotary tables, one mask per attention layer type, and shifted labels.

        Packed rows (``position_ids`` given, restarting at each document) get HF's packed-sequence masks:
        causal, and sliding-window where the layer slides, within each document only. HF's builders
        would find the documents themselves from ``position_ids``, but ``find_packed_sequence_indices``
        then tests a device tensor with ``.all()`` in Python: a CPU-GPU sync per builder call, so per
        micro-batch. Instead the engine decides on the host whether rows are packed at all (Note
        [Packed micro-batches] in slide_core/engine/micro_batch.py) and passes None for plain ones, and
        here the builders get the document ids as ``and_mask_function``, with the same per-document
        predicate (``packed_sequence_mask_function``); like HF's packed path that turns off SDPA's
        ``is_causal`` shortcut for sdpa and eager alike (flex turns the predicate into its block mask).
        Tested against HF's own detection by ``test_packed_masks_equal_hf_detection``.

        HF's flash-attention path builds no mask: it finds documents from the position ids itself, and
        only in a batch of one row (``_is_packed_sequence``); in a batch of several packed rows it would
        let documents attend to each other, so that combination is refused in one line.
        """
        batch, seq = input_ids.shape
        device = input_ids.device
        same_document = None
        if position_ids is None:
            position_ids = torch.arange(seq, device=device).unsqueeze(0)
        else:
            refuse_packing(self, packing=True)
            same_document = packed_sequence_mask_function(_document_ids(position_ids))
        if self.linear_attention is not None:  # decided before any block runs on this device (a GPU check)
            self.linear_attention.path_for(device, dtype)
        # HF's mask builders and rotary read only (batch, seq, dtype, device) of the hidden states.
        probe = torch.empty((batch, seq, 0), dtype=dtype, device=device)
        masks = {}
        for kind in {b.attention_type for b in self.blocks}:
            config = self.attention_config(kind, device.type, dtype)
            if same_document is not None and batch > 1 and config._attn_implementation.startswith("flash_"):
                raise UserError(
                    f"{config._attn_implementation} cannot keep the documents of packed rows apart in a "
                    f"micro-batch of {batch} rows (transformers finds them in a single row only); use a batch "
                    "size of 1 or another attention implementation"
                )
            masks[kind] = _MASK_BUILDERS[kind](
                config=config,
                inputs_embeds=probe,
                attention_mask=None,
                past_key_values=None,
                position_ids=None,  # no detection on the device (see above)
                and_mask_function=same_document,
            )
        rotary = None
        if self.rotary_embedding is not None:
            rotary = self._rotary_on(device)(probe, position_ids)
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
        return HFInputs(position_ids, rotary, masks, shift_labels)

    def _rotary_on(self, device: torch.device) -> nn.Module:
        rotary = self._rotary.get(device)
        if rotary is None:
            with torch.device(device):
                rotary = self.rotary_embedding(self.config)  # type: ignore[misc]
            self._rotary[device] = rotary
        return rotary

    def loss_token_count(self, labels: torch.Tensor) -> int:
        """The step's divisor: label tokens, or with a preference objective the pairs (Note [Tagged
        preference labels] in slide_hf/preference/tags.py), so the loss is the mean over the step's pairs."""
        if self.head.preference is not None:
            return pair_count(labels)
        return super().loss_token_count(labels)

    def extra_tensors_bytes(self) -> int:
        """Rotary buffers (``inv_freq`` and its copy, fp32): the only device state outside units."""
        if self.rotary_embedding is None:
            return 0
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return 2 * (head_dim // 2) * 4


def _document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, S): each token's document number within its row, counting from 0; a document starts wherever
    the position ids do not step by +1. Computed on the ids' device without reading them on the host."""
    restart = torch.zeros_like(position_ids, dtype=torch.bool)
    restart[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return restart.cumsum(-1)


def _runtime_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """A private copy with HF's defaults resolved the way ``from_config``/``from_pretrained`` would.

    ``_attn_implementation`` stays as the caller left it: unset, the attention is chosen per layer type
    and device (:meth:`HFCausalLM.attention_for`); a fixed default (HF's is sdpa) would drop Gemma 2's
    attention logit cap.
    """
    config = copy.deepcopy(config)
    if getattr(config, "_experts_implementation", None) is None and _has_experts(config):
        config._experts_implementation = "grouped_mm"
    return config


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
"""How configs name their routed experts: Qwen3-MoE and Qwen3-Next ``num_experts``, Llama 4
``num_local_experts``, DeepSeek-V3 ``n_routed_experts``."""


def _has_experts(config: PreTrainedConfig) -> bool:
    """Whether ``config`` routes tokens to experts, whatever its family calls their count. HF's
    ``from_config`` gives every such model the ``grouped_mm`` experts; left unset, an experts class falls
    back to its per-expert loop (DeepSeek-V3's streamed blocks ran at 8 % of the card's matmul rate)."""
    return any(getattr(config, name, None) for name in _EXPERT_COUNTS)


def _repoint_config(root: nn.Module, old: PreTrainedConfig, new: PreTrainedConfig) -> None:
    """Make every module under ``root`` that holds ``old`` as its ``config`` hold ``new`` instead.

    Why after building: families build layers from ``self.config`` in their own ``make_layer`` hooks, and
    HF's attention modules look ``config._attn_implementation`` up at call time, so this is what gives a
    layer type its own implementation without every family passing a per-type config.
    """
    for module in root.modules():
        if getattr(module, "config", None) is old:
            module.config = new  # type: ignore[assignment]  # nn.Module types attributes as Tensor | Module


def _named_parameters_of(fn: Callable[..., Any]) -> frozenset[str]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds)
