"""What a plan is computed from: the machine's bandwidths, the model's shape and one training configuration.

Everything is validated here, when it is built, so the byte and time models downstream can trust their
inputs and stay plain arithmetic. Only slide-core's config and unit types are imported: a
:class:`ModelShape` can be read from a model on the meta device, or filled by hand without one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from slide_core.engine.config import EngineConfig
from slide_core.engine.layout import RunLayout
from slide_core.master_store import MasterFormat
from slide_core.optim.adamw_config import AdamWConfig
from slide_core.optim.state_formats import StateArray, state_arrays
from slide_core.optimizer import Optimizer
from slide_core.tier import Tier
from slide_core.unit import SlideModel
from slide_hf.defaults import DEFAULT_SEQ_LEN
from slide_hf.errors import UserError
from slide_hf.planner.activations import BlockActivations
from slide_hf.spelling import option

__all__ = ["Bandwidths", "ModelShape", "Offload", "PlanInputs"]

Offload = Literal["ram", "nvme"]


STATE_SPEED = {"fp32": 1.0, "bf16": 1.15, "int8": 0.73}
"""Host AdamW updates per second with a compact state, relative to fp32 state, where none is measured:
bench/cpu_adam.py on the H200 machine's host (16 threads, 100M parameters): fp32 4.25, bf16 4.88, int8 3.09
Gparam/s. bf16 moves 18 bytes instead of 26 but hashes and rounds every element; int8 (two passes per
64-element block) is bound by its arithmetic there (44 GB/s effective against the triad's 77), so it saves
memory, not time."""

SPLIT_MASTER_SPEED = 0.875
"""Host AdamW updates per second with a split master (slide_core/split_master.py: the kernel decodes the bf16
and int16 planes and the tie bit, and encodes them again), relative to an fp32 master with the same state,
where ``slide doctor`` measured none. Measured on an H200 (16 cores, 128 GiB), llama3.1-8b, batch 16 x 1024,
in the engine: 3.5 Gparam/s with a split master and bf16 state against 4.0 Gparam/s with an fp32 master and
fp32 state (the fused kernel's fp32 and bf16 state rates are within 1% of each other there): 3.5 / 4.0."""

DUPLEX_SPEED = 1.2
"""Both PCIe directions together, relative to the slower direction alone, where ``slide doctor`` measured no
duplex rate. Measured on an H200 (16 cores, 128 GiB, PCIe 5): llama3.1-8b with every unit GPU-streamed moved
~128 GB h2d and ~96 GB d2h per step in 3.40 s, ~66 GB/s for the two together against 55 GB/s each way alone."""


HOST_ADAM_BUSY_SHARE = 0.68
"""The host AdamW's rate while it works inside a step, relative to ``slide doctor``'s measurement of it
alone (the schedule models its idle time itself; ``HOST_ADAM_IN_STEP`` in unit_costs.py folds that idle time in). Measured on
an H100 host (16 cores, 128 GiB), llama3.1-8b, batch 16 x 1024, --gpu-memory 24: fp32 master and state,
7.4e9 host-updated parameters in 1.43 s of updates, 5.2 Gparam/s, 0.68 of the doctor's 7.66; split master
and bf16 state 0.86 of its 5.93 (docs/benchmarks.md, "Where each unit's update runs"); on an H200 host
0.66-0.67 (Note [The host optimizer inside a step] in unit_costs.py)."""


@dataclass(frozen=True)
class Bandwidths:
    """Throughputs the step-time estimate divides by (GB/s are 1e9 bytes/s).

    The defaults are conservative: a PCIe 4 x16 link, a desktop-class CPU, a GPU at modest utilisation.
    Measured on the H200 machine (16 cores, PCIe 5): h2d 55.5 GB/s and d2h 55.3 GB/s from pinned memory;
    ``torch._fused_adamw_`` at 4.8 Gparam/s on fp32 alone, 1.6-2.2 Gparam/s including the bf16 -> fp32
    gradient casts the engine does (see :meth:`measured_h200`).

    - ``cpu_adam_gparams``: AdamW updates per second on the host, in 1e9 parameters/s, casts included.
    - ``host_mem_gbps``: host memory bandwidth available to the optimizer and gradient accumulation.
    - ``gpu_tflops``: *achieved* dense compute-dtype throughput (not the datasheet peak).
    - ``disk_gbps``: sustained NVMe throughput for offloaded optimizer state and activations.
    - ``gpu_mem_gbps``: GPU memory bandwidth, which bounds an AdamW update on the GPU (resident and
      GPU-streamed units); the default is a conservative HBM figure (an H100 PCIe card's copy rate).
    - ``cpu_adam_state_gparams``: measured ``(state format, Gparam/s)`` pairs (slide_hf/machine_rates.py);
      a format without one runs at ``cpu_adam_gparams`` times its relative speed (:meth:`cpu_adam_rate`).
    - ``cpu_adam_split_state_gparams``: the same with a split master; a format without one runs at its
      fp32-master rate times ``SPLIT_MASTER_SPEED``.
    - ``pcie_duplex_gbps``: h2d and d2h bytes together per second while both directions copy at once (each
      direction alone is faster than half of it, together slower than the sum); None: ``DUPLEX_SPEED``
      times the slower direction (:attr:`duplex_gbps`).
    - ``cpu_adam_busy_gparams``: ``(master format, state format, Gparam/s)`` of the host AdamW *inside training
      steps* while it works (its update spans), which a run measures and writes to this machine's cache
      (slide_hf/in_step_rates.py); where one is missing, the stand-alone rate times ``HOST_ADAM_BUSY_SHARE``
      (:meth:`cpu_adam_busy_rate`).

    ``slide doctor`` measures all but the disk on this machine and caches them; planning reads that cache
    (:func:`slide_hf.machine_rates.planning_bandwidths`) and otherwise uses these defaults.
    """

    h2d_gbps: float = 25.0
    d2h_gbps: float = 25.0
    cpu_adam_gparams: float = 1.0
    host_mem_gbps: float = 60.0
    gpu_tflops: float = 300.0
    disk_gbps: float = 2.0
    gpu_mem_gbps: float = 1500.0
    cpu_adam_state_gparams: tuple[tuple[str, float], ...] = ()
    cpu_adam_split_state_gparams: tuple[tuple[str, float], ...] = ()
    pcie_duplex_gbps: float | None = None
    cpu_adam_busy_gparams: tuple[tuple[str, str, float], ...] = ()

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            if item.name in (
                "cpu_adam_state_gparams",
                "cpu_adam_split_state_gparams",
                "pcie_duplex_gbps",
                "cpu_adam_busy_gparams",
            ):
                continue
            value = getattr(self, item.name)
            if not value > 0:
                raise UserError(f"bandwidth {item.name} must be > 0, got {value}")
        for master, pairs in (("fp32", self.cpu_adam_state_gparams), ("split", self.cpu_adam_split_state_gparams)):
            for state, value in pairs:
                if not value > 0:
                    raise UserError(
                        f"bandwidth cpu_adam_gparams for {state} state, {master} master must be > 0, got {value}"
                    )
        if self.pcie_duplex_gbps is not None and not self.pcie_duplex_gbps > 0:
            raise UserError(f"bandwidth pcie_duplex_gbps must be > 0, got {self.pcie_duplex_gbps}")
        for master, state, value in self.cpu_adam_busy_gparams:
            if not value > 0:
                raise UserError(f"in-step host AdamW rate for {state} state, {master} master must be > 0, got {value}")

    def cpu_adam_rate(self, optimizer_state: str, master_format: str = "fp32") -> float:
        """Host AdamW updates per second (1e9 params/s) with ``optimizer_state`` moments and a
        ``master_format`` master: measured, or, for an fp32 master, ``cpu_adam_gparams`` scaled by the
        format's speed relative to fp32 (``STATE_SPEED``); for a split master, the fp32-master rate times
        ``SPLIT_MASTER_SPEED``."""
        if master_format == "split":
            split = dict(self.cpu_adam_split_state_gparams)
            if optimizer_state in split:
                return split[optimizer_state]
            return self.cpu_adam_rate(optimizer_state) * SPLIT_MASTER_SPEED
        measured = dict(self.cpu_adam_state_gparams)
        if optimizer_state in measured:
            return measured[optimizer_state]
        return self.cpu_adam_gparams * STATE_SPEED[optimizer_state]

    def cpu_adam_busy_rate(self, optimizer_state: str, master_format: str = "fp32") -> float:
        """Host AdamW updates per second (1e9 params/s) while it works inside a training step: measured in
        this machine's earlier steps with these formats, else the stand-alone rate (:meth:`cpu_adam_rate`)
        times ``HOST_ADAM_BUSY_SHARE``, the share of it measured steps reached on an H100 and an H200 host."""
        for master, state, value in self.cpu_adam_busy_gparams:
            if (master, state) == (master_format, optimizer_state):
                return value
        return self.cpu_adam_rate(optimizer_state, master_format) * HOST_ADAM_BUSY_SHARE

    @property
    def duplex_gbps(self) -> float:
        """GB/s of h2d and d2h together while both run: measured, or ``DUPLEX_SPEED`` times the slower one."""
        if self.pcie_duplex_gbps is not None:
            return self.pcie_duplex_gbps
        return DUPLEX_SPEED * min(self.h2d_gbps, self.d2h_gbps)

    @classmethod
    def measured_h200(cls) -> Bandwidths:
        """The H200 machine's measured transfer and optimizer rates (GPU and disk left conservative)."""
        return cls(h2d_gbps=55.5, d2h_gbps=55.3, cpu_adam_gparams=1.9)


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs from a model: the padded size of every unit and the architecture's widths.

    ``*_numel`` are ``unit.layout.numel`` (alignment padding included: that is what the engine allocates);
    ``params`` is the HF-style count (no padding, a tied matrix once). Built from a :class:`SlideModel`
    with :meth:`of`; tests and callers without a model can fill it by hand.
    """

    embedding_numel: int
    block_numels: tuple[int, ...]
    head_numel: int
    params: int
    block_params: int
    tied: bool
    hidden_size: int
    num_heads: int
    head_dim: int
    kv_dim: int
    intermediate_size: int
    vocab_size: int
    extra_device_bytes: int = 0
    stream_width: int | None = None
    """The width of the activation the units pass each other (:meth:`SlideModel.activation_width`); None:
    the hidden size. Use :attr:`activation_width`."""
    unit_names: tuple[str, ...] = ()
    """Every unit's name in forward order, as the model calls them (what ``resident_units`` and the other
    placements name); empty: slide-hf's names, ``embedding``, ``block.0`` ... ``head`` (:attr:`names`)."""
    activations: BlockActivations | None = field(default=None, compare=False, repr=False)
    """Measures what each kind of block saves for autograd (:mod:`slide_hf.planner.activations`); None
    (a shape filled by hand, a model that is not an HF adapter's): the planner's formula."""

    @classmethod
    def of(cls, model: SlideModel) -> ModelShape:
        """Read the shape of ``model``: unit layouts from the units, widths from its config.

        HF adapters keep the transformers config as ``model.config``; slide-core's ``ToyModel`` keeps a
        ``cfg``. Missing widths fall back to the embedding matrix (vocab, hidden) and Llama-style defaults.
        """
        config = getattr(model, "config", None) or getattr(model, "cfg", None)
        vocab, hidden = _embedding_matrix(model)
        hidden = int(_first(config, ("hidden_size", "n_embd"), hidden))
        heads = int(_first(config, ("num_attention_heads", "num_heads", "n_head"), max(1, hidden // 128)))
        head_dim, kv_dim = _attention_widths(config, heads, hidden // heads)
        intermediate = int(_first(config, ("intermediate_size", "n_inner"), 4 * hidden))
        routed = _first(config, ("moe_intermediate_size",), None)
        top_k = _first(config, ("num_experts_per_tok", "top_k_experts"), None)
        if routed and top_k:  # an MoE token runs top_k experts' MLPs
            intermediate = max(intermediate, int(routed) * int(top_k))
        blocks = tuple(unit.layout.numel for unit in model.blocks)
        return cls(
            embedding_numel=model.embedding.layout.numel,
            block_numels=blocks,
            head_numel=model.head.layout.numel,
            params=sum(unit.layout.param_numel for unit in model.units),
            block_params=sum(unit.layout.param_numel for unit in model.blocks),
            tied=bool(model.head.borrowed),
            hidden_size=hidden,
            num_heads=heads,
            head_dim=head_dim,
            kv_dim=kv_dim,
            intermediate_size=intermediate,
            vocab_size=int(_first(config, ("vocab_size",), vocab)),
            extra_device_bytes=int(model.extra_tensors_bytes()),
            stream_width=model.activation_width(),
            unit_names=tuple(unit.name for unit in model.units),
            activations=BlockActivations.of(model),
        )

    @property
    def activation_width(self) -> int:
        """Elements per token of the activation stashed for each block, sent between host and GPU and
        held (with its gradient) between units: the hidden size unless the model widens it."""
        return self.stream_width or self.hidden_size

    @property
    def names(self) -> tuple[str, ...]:
        """Every unit's name in forward order: embedding, blocks, head."""
        if self.unit_names:
            return self.unit_names
        return ("embedding", *(f"block.{i}" for i in range(self.num_blocks)), "head")

    @property
    def block_names(self) -> frozenset[str]:
        return frozenset(self.names[1:-1])

    @property
    def named_numels(self) -> dict[str, int]:
        """Every unit's padded numel by name, in forward order."""
        return dict(zip(self.names, self.unit_numels, strict=True))

    @property
    def num_blocks(self) -> int:
        return len(self.block_numels)

    @property
    def unit_numels(self) -> tuple[int, ...]:
        """Every unit's padded numel in forward order: embedding, blocks, head."""
        return (self.embedding_numel, *self.block_numels, self.head_numel)

    @property
    def total_numel(self) -> int:
        return sum(self.unit_numels)

    @property
    def max_block_numel(self) -> int:
        return max(self.block_numels, default=0)


def _attention_widths(config: Any, heads: int, default_head_dim: int) -> tuple[int, int]:
    """``(head_dim, kv_heads * head_dim)`` of the widest layer.

    transformers' heterogeneous configs keep these per layer (``per_layer_config``; Gemma 4's full layers
    have twice the head size and fewer kv heads than its sliding ones) and refuse to read them globally,
    so each layer's view is read; configs without per-layer values give one answer for every layer.
    """
    layers = getattr(config, "per_layer_config", None) if config is not None else None
    count = int(getattr(config, "num_hidden_layers", 0) or 0) if layers is not None else 0
    views = [layers[i] for i in range(count)] if count and layers is not None else [config]
    widths = []
    for view in views:
        head_dim = int(_first(view, ("head_dim",), default_head_dim))
        widths.append((head_dim, int(_first(view, ("num_key_value_heads", "num_kv_heads"), heads)) * head_dim))
    return max(w[0] for w in widths), max(w[1] for w in widths)


def _first(config: Any, names: tuple[str, ...], default: Any) -> Any:
    for name in names:
        value = getattr(config, name, None) if config is not None else None
        if value:
            return value
    return default


def _embedding_matrix(model: SlideModel) -> tuple[int, int]:
    for spec in model.embedding.layout:
        if len(spec.shape) == 2:
            return spec.shape[0], spec.shape[1]
    raise UserError(f"cannot plan {type(model).__name__}: its embedding unit has no (vocab, hidden) matrix")


_ENGINE_DEFAULTS = EngineConfig()


@dataclass(frozen=True)
class PlanInputs:
    """One training configuration to plan.

    ``model`` is a :class:`SlideModel` (HF modules on the meta device are enough) or a ready
    :class:`ModelShape`. ``gpu_memory_bytes`` / ``host_memory_bytes`` cap what ``max_batch_size`` may use
    (None: no cap on that side). With ``offload_optimizer == "nvme"``, ``nvme_fraction`` of the units
    (counted in units, rounded; blocks first in index order, then the embedding, then the head) keep m
    and v on NVMe. ``fused_loss`` says slide-kernels' chunked linear + cross-entropy will run the head
    (without it, HF's recipe materialises the whole logits). ``transfer_chunk_numel`` and
    ``grad_ring_slots`` are the engine's (``EngineConfig``).
    """

    model: SlideModel | ModelShape
    batch_size: int = 1
    seq_len: int = DEFAULT_SEQ_LEN
    seq_tile: int = 0
    """Tokens per tile of the blocks' MLPs (``--seq-tile`` as it resolves, slide_hf/defaults.py): a
    micro-batch of more tokens holds one tile's MLP intermediates in its backward, not the whole
    sequence's (slide_hf/adapters/tiled_mlp.py; priced in slide_hf/planner/seq_tiles.py). 0: untiled."""
    packed_rows: bool = False
    """Rows may hold several documents (`slide train`'s packing, on unless ``--no-packing``): with SDPA, every
    attention layer then needs an explicit (S x S) mask (slide_hf/planner/attention_masks.py)."""
    grad_accum: int = 1
    compute_dtype_bytes: int = 2
    block_slots: int = _ENGINE_DEFAULTS.block_slots
    gpu_memory_bytes: int | None = None
    accelerator: bool = True  # the run computes on a GPU (False: the CPU device): its runtime's host memory
    host_memory_bytes: int | None = None
    offload_optimizer: Offload = "ram"
    state_tier: bool = False
    """``--offload-optimizer`` names a tier (any but host RAM): ``nvme_fraction`` of the units keep their state
    on it. A tier that keeps its bytes on disk is planned as ``offload_optimizer == "nvme"`` (NVMe bytes and
    traffic); one that keeps them in memory (``pinned``) as ``ram``, its bytes on the host."""
    nvme_fraction: float = 1.0
    offload_activations: Offload = "ram"
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    fused_loss: bool = True
    transfer_chunk_numel: int = _ENGINE_DEFAULTS.transfer_chunk_numel
    grad_ring_slots: int = _ENGINE_DEFAULTS.grad_ring_slots
    resident_units: tuple[str, ...] = ()
    """Units whose master and Adam state live on the GPU (``EngineConfig.resident_units``)."""
    streamed_units: tuple[str, ...] = ()
    """Units updated on the GPU as they stream through it (``EngineConfig.streamed_units``): master and
    moments cross PCIe with the unit instead of the gradient, and the host optimizer does nothing for them."""
    streamable_units: tuple[str, ...] = ()
    """Units besides ``streamed_units`` a run may move to the GPU-streamed update, and back, between steps
    when its steps measure other rates than the plan's (``EngineConfig.streamable_units``,
    slide_hf/replacement.py): they start on the host, and the staging is priced for the largest of them
    and the streamed units (:func:`~slide_hf.planner.plan.with_streamable` chooses them)."""
    staging_sets: int = _ENGINE_DEFAULTS.staging_sets
    """Device staging sets of the streamed units (``EngineConfig.staging_sets``): three, or two where the
    GPU budget cannot hold three (:func:`~slide_hf.planner.plan.plan_with_placement`)."""
    master_format: MasterFormat = "fp32"
    """``--master`` as it resolves: ``fp32`` (the h2d reads 4 B/param and casts on the GPU) or ``split``
    (2 B/param, the bf16 plane as it is; the host holds 4 B/param + 1 tie bit; bf16 compute only)."""
    max_grad_norm: float = 0.0
    """``--max-grad-norm``; above 0 (:attr:`clipping`) gradients land in a full-model pinned store (for the
    exact rollback) instead of the ring."""
    objective: str = "sft"
    """``--objective`` (sft, dpo, simpo): a preference head runs the LM head's matmul once more per token (its
    log-probabilities without grad, Note [Preference loss through a weighted cross-entropy] in
    slide_hf/preference/head.py), and DPO runs a reference pass, one forward of every pair, before the first
    step (``Plan.reference_step_s``)."""
    report_grad_norm: bool | None = None
    """``EngineConfig.report_grad_norm``; None: as `slide train` decides it (with one micro-batch, or with
    clipping, where the norm costs nothing more)."""
    optimizer_state: str = "fp32"
    """How the host keeps Adam's m and v (fp32, bf16 or int8; the option of that name), which sets their host
    and NVMe bytes and the bytes the host optimizer moves per step."""
    optimizer: Optimizer | None = field(default=None, compare=False, repr=False)
    """The run's optimizer: its ``device_replica`` updates the resident units, and the scratch that replica
    reports (``Optimizer.device_scratch_bytes``) is on the GPU peak. None: the shipped optimizer for
    ``optimizer_state`` (:meth:`device_optimizer`)."""
    state_tier_class: type[Tier] | None = field(default=None, compare=False, repr=False)
    """The class of the tier ``--offload-optimizer`` names (None: host RAM, or a plan that does not say):
    the host RAM it holds of its own, a slab or bounce buffers (``Tier.host_bytes_for``), is priced with
    the engine's buffers."""
    activation_tier_class: type[Tier] | None = field(default=None, compare=False, repr=False)
    """The same for the tier on disk ``--offload-activations`` names (None: the engine's host stash)."""

    def __post_init__(self) -> None:
        from slide_hf.options import check_option

        # The options a user gives, by their one rule each (slide_hf/options); the rules between options
        # were applied where the options were built (TrainConfig.validate), before anything was resolved.
        names = (
            "batch_size",
            "seq_len",
            "seq_tile",
            "grad_accum",
            "block_slots",
            "nvme_fraction",
            "optimizer_state",
        )
        for name in names:
            check_option(name, getattr(self, name))
        for name in ("transfer_chunk_numel", "grad_ring_slots"):  # the engine's, not an option
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        if self.objective not in ("sft", "dpo", "simpo"):
            raise UserError(f"{option('objective')} must be one of sft, dpo, simpo, got {self.objective!r}")
        if self.compute_dtype_bytes not in (2, 4):
            raise UserError(f"compute dtype must be 2 (bf16) or 4 (fp32) bytes, got {self.compute_dtype_bytes}")
        for name in ("offload_optimizer", "offload_activations"):  # how a tier's bytes are counted
            if getattr(self, name) not in ("ram", "nvme"):
                raise UserError(f"{option(name)} must be planned as 'ram' or 'nvme', got {getattr(self, name)!r}")
        if self.master_format not in ("fp32", "split"):
            raise UserError(f"{option('master')} must resolve to fp32 or split, got {self.master_format!r}")
        if self.master_format == "split" and self.compute_dtype_bytes != 2:
            raise UserError(f"{option('master', 'split')} stores the bf16 compute copy: it needs --dtype bfloat16")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            raise UserError(f"{option('max_grad_norm')} must be a finite number >= 0, got {self.max_grad_norm}")
        for name in ("gpu_memory_bytes", "host_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"{option(name.removesuffix('_bytes'))} must be positive, got {value}")
        self._placed_by_name()

    def _placed_by_name(self) -> None:
        """Name the placed units as the model does: slide-hf's names (``embedding``, ``block.0``, ``head``)
        stand for the unit at that position of a model whose units are called otherwise, so the engine
        config built from these inputs names units the engine has."""
        names = self.model.names if isinstance(self.model, ModelShape) else tuple(u.name for u in self.model.units)
        standard = ("embedding", *(f"block.{i}" for i in range(len(names) - 2)), "head")
        known, alias = set(names), dict(zip(standard, names, strict=True))
        for field_name in ("resident_units", "streamed_units", "streamable_units"):
            units = getattr(self, field_name)
            unknown = [name for name in units if name not in known and name not in alias]
            if unknown:
                raise UserError(f"{field_name} names units the model does not have: {', '.join(unknown)}")
            named = tuple(name if name in known else alias[name] for name in units)
            if named != units:
                object.__setattr__(self, field_name, named)

    @functools.cached_property
    def shape(self) -> ModelShape:
        return self.model if isinstance(self.model, ModelShape) else ModelShape.of(self.model)

    @property
    def preference(self) -> bool:
        """Whether the head computes a preference loss (``--objective`` dpo or simpo)."""
        return self.objective != "sft"

    @property
    def clipping(self) -> bool:
        """Whether gradient-norm clipping is on (``max_grad_norm > 0``)."""
        return self.max_grad_norm > 0

    @property
    def offloaded_units(self) -> tuple[str, ...]:
        """The units whose optimizer state lives on the state tier (``EngineConfig.offloaded_units``): with a
        tier (:attr:`state_tier`, or NVMe), ``nvme_fraction`` of the units by the run's own rule
        (:func:`slide_hf.offload.offloaded_names`); none otherwise."""
        if self.offload_optimizer != "nvme" and not self.state_tier:
            return ()
        from slide_hf.offload import offloaded_names

        return offloaded_names(self.shape.names, self.nvme_fraction, (*self.resident_units, *self.streamed_units))

    def engine_config(self) -> EngineConfig:
        """The engine config of the run these inputs describe: what the run's engine is built with
        (slide_hf/setup.py's ``open_engine``) and what the planner prices, built here once so the two
        cannot differ."""
        clipping = self.clipping
        return dataclasses.replace(
            _ENGINE_DEFAULTS,
            block_slots=self.block_slots,
            compute_dtype=torch.float32 if self.compute_dtype_bytes == 4 else torch.bfloat16,
            master_format=self.master_format,
            transfer_chunk_numel=self.transfer_chunk_numel,
            grad_ring_slots=self.grad_ring_slots,
            resident_units=self.resident_units,
            offloaded_units=self.offloaded_units,
            streamed_units=self.streamed_units,
            streamable_units=self.streamable_units,
            staging_sets=self.staging_sets,
            max_grad_norm=self.max_grad_norm,
            report_grad_norm=(self.grad_accum == 1 or clipping)
            if self.report_grad_norm is None
            else self.report_grad_norm,
        )

    def layout(self, shape: ModelShape | None = None) -> RunLayout:
        """Where each unit of the planned run lives and is updated (slide_core's :class:`RunLayout`);
        ``shape``: this model's, when the caller has it."""
        shape = shape if shape is not None else self.shape
        return RunLayout(self.engine_config(), tuple(shape.named_numels.items()), tied=shape.tied)

    def state_arrays(self) -> tuple[StateArray, ...]:
        """How the run's optimizer stores its state (``Optimizer.state_arrays``): the run's, or the
        shipped one's for ``optimizer_state``."""
        return self.optimizer.state_arrays if self.optimizer is not None else state_arrays(self.optimizer_state)

    def device_optimizer(self) -> Optimizer:
        """The optimizer that updates device-resident units: the run's ``device_replica``, or, without
        one, that of the shipped optimizer for ``optimizer_state`` (every shipped AdamW's replica runs
        the same torch ops on the device). Built without compiling anything."""
        if self.optimizer is not None:
            return self.optimizer.device_replica()
        from slide_core.optim import TorchAdamW
        from slide_core.optim.compact_adamw import CompactAdamW

        config = AdamWConfig(state_format=self.optimizer_state)
        if self.optimizer_state == "fp32":
            return TorchAdamW(config).device_replica()
        return CompactAdamW(config, fused=False).device_replica()
