"""Memory and step-time planning: what a SlideFormer run needs before any byte is allocated.

The host side mirrors, buffer by buffer, what the engine allocates (``slide_core.engine``): the fp32
master slab (``HostParameters``), AdamW's m and v (``UnitUpdates.state_slabs``), fp32 gradient
accumulators for units with more than one gradient contribution per step, the pinned gradient ring
(``GradRing``), the pinned activation stash (``ActivationStash``) and the optimizer's fp32 cast scratch
(``TorchAdamW.reserve``). Those are exact (tests compare them with a real engine); the process baseline,
NVMe staging (the engine has no NVMe tier yet; this is the budget one needs) and everything on the GPU
beyond the preallocated slots are estimates from the model's shapes.

The GPU peak is the persistent part (parameter/gradient slots, the two activation buffers, the CUDA
context) plus the largest transient of the four phases of a micro-batch: the no-grad forward of one
block, the head (slide-kernels' chunked linear + cross-entropy, or HF's full logits without it), the
recomputed backward of one block, and the embedding backward. Only one runs at a time, so they do not add.

Step time assumes perfect overlap of the pipelines the engine runs concurrently (GPU compute, PCIe in
each direction, the CPU optimizer, NVMe when used) and takes the slowest; see :func:`make_plan` for each
formula. It is a planning number (within tens of percent), not a benchmark.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import psutil

from slide_core.engine.config import EngineConfig
from slide_core.unit import SlideModel
from slide_hf.errors import UserError

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "ENGINE_HOST_BUFFERS",
    "PROCESS_BASELINE_BYTES",
    "Bandwidths",
    "ModelShape",
    "Plan",
    "PlanInputs",
    "available_host_bytes",
    "check_fits",
    "format_bytes",
    "largest_batch",
    "make_plan",
    "parse_size",
]

GiB = 1 << 30

PROCESS_BASELINE_BYTES = 1 * GiB
"""Resident memory of a training process before any engine buffer: Python, torch, transformers and the
meta-device model. Measured on CPU at ~0.5 GB (``tests/hf/test_planner.py`` checks it stays below this);
a CUDA build adds the host side of the CUDA runtime and cuBLAS, hence the round 1 GiB."""

CUDA_CONTEXT_BYTES = 512 << 20
"""GPU memory the CUDA context and cuBLAS workspaces take before the first tensor (~0.5 GB on H100/H200)."""

_BLOCK_WORKSPACE_FACTOR = 1.5
"""Calibration constant: peak GPU bytes of one block's recompute + backward over the bytes of the
tensors autograd saves (:func:`_saved_elems_per_token`). The excess over 1 is the gradients of the
largest intermediates (MLP backward: grads of ``act * up``, ``gate`` and ``up``, about 3 x intermediate
per token) that live alongside the saved tensors. To be tuned against ``torch.cuda.max_memory_allocated``
on a GPU."""

_CE_CHUNK_LOGITS_BYTES = 256 << 20
"""``slide_kernels.ops.linear_cross_entropy.CHUNK_LOGITS_BYTES``: the fused head's one (rows, vocab)
logits buffer. Copied, not imported, so planning never imports triton."""

_H2D_BYTES_PER_PARAM = 4
"""Bytes per parameter per load: the engine copies straight from the fp32 master slab into the
compute-dtype slot (``Engine._h2d_job``); a non-blocking cross-dtype host-to-device copy moves the
source's fp32 bytes and casts on the device."""

_ADAM_BYTES_PER_PARAM = 32
"""Host memory traffic of one fp32 AdamW update per parameter: read and write master, m and v (24 B),
and the gradient cast into the fp32 scratch and read back (8 B)."""

Offload = Literal["ram", "nvme"]

ENGINE_HOST_BUFFERS = (
    "master_fp32",
    "optimizer_state",
    "grad_accumulators",
    "grad_ring",
    "activation_stash",
    "optimizer_scratch",
)
"""Keys of ``Plan.host_breakdown`` that are buffers the engine itself allocates."""


# ---------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------
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
    """

    h2d_gbps: float = 25.0
    d2h_gbps: float = 25.0
    cpu_adam_gparams: float = 1.0
    host_mem_gbps: float = 60.0
    gpu_tflops: float = 300.0
    disk_gbps: float = 2.0

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if not value > 0:
                raise UserError(f"bandwidth {item.name} must be > 0, got {value}")

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
        head_dim = int(_first(config, ("head_dim",), hidden // heads))
        kv_heads = int(_first(config, ("num_key_value_heads", "num_kv_heads"), heads))
        intermediate = int(_first(config, ("intermediate_size", "n_inner"), 4 * hidden))
        routed = _first(config, ("moe_intermediate_size",), None)
        top_k = _first(config, ("num_experts_per_tok",), None)
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
            kv_dim=kv_heads * head_dim,
            intermediate_size=intermediate,
            vocab_size=int(_first(config, ("vocab_size",), vocab)),
            extra_device_bytes=int(model.extra_tensors_bytes()),
        )

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
    seq_len: int = 2048
    grad_accum: int = 1
    compute_dtype_bytes: int = 2
    block_slots: int = _ENGINE_DEFAULTS.block_slots
    gpu_memory_bytes: int | None = None
    host_memory_bytes: int | None = None
    offload_optimizer: Offload = "ram"
    nvme_fraction: float = 1.0
    offload_activations: Offload = "ram"
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    fused_loss: bool = True
    transfer_chunk_numel: int = _ENGINE_DEFAULTS.transfer_chunk_numel
    grad_ring_slots: int = _ENGINE_DEFAULTS.grad_ring_slots
    resident_units: tuple[str, ...] = ()
    """Units whose master and Adam state live on the GPU (``EngineConfig.resident_units``)."""
    clipping: bool = False
    """``--max-grad-norm > 0``: gradients land in a full-model pinned store (for the exact rollback)."""

    def __post_init__(self) -> None:
        for name, flag in (
            ("batch_size", "--batch-size"),
            ("seq_len", "--seq-len"),
            ("grad_accum", "--grad-accum"),
            ("block_slots", "--block-slots"),
            ("transfer_chunk_numel", "transfer_chunk_numel"),
            ("grad_ring_slots", "grad_ring_slots"),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{flag} must be a positive integer, got {value!r}")
        if self.compute_dtype_bytes not in (2, 4):
            raise UserError(f"compute dtype must be 2 (bf16/fp16) or 4 (fp32) bytes, got {self.compute_dtype_bytes}")
        for name, flag in (
            ("offload_optimizer", "--offload-optimizer"),
            ("offload_activations", "--offload-activations"),
        ):
            if getattr(self, name) not in ("ram", "nvme"):
                raise UserError(f"{flag} must be 'ram' or 'nvme', got {getattr(self, name)!r}")
        if not 0.0 <= self.nvme_fraction <= 1.0:
            raise UserError(f"--nvme-fraction must be between 0 and 1, got {self.nvme_fraction}")
        for name, flag in (("gpu_memory_bytes", "--gpu-memory"), ("host_memory_bytes", "--host-memory")):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"{flag} must be positive, got {value}")

    @property
    def shape(self) -> ModelShape:
        return self.model if isinstance(self.model, ModelShape) else ModelShape.of(self.model)


# ---------------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Memory and time for one :class:`PlanInputs`. Byte counts are exact integers; times in seconds.

    ``gpu_breakdown`` / ``host_breakdown`` sum to the peaks. ``max_batch_size`` is the largest batch
    that fits every cap set in the inputs (None when none is set; 0 when not even 1 fits) and
    ``max_batch_limit`` says which cap binds. ``eta`` is T_bwd / (T_d2h + T_update) for the whole step
    (>= 1: gradient transfer and update hide behind the backward); ``critical_batch_size`` is the
    smallest batch with eta >= 1.
    """

    inputs: PlanInputs = field(repr=False)
    shape: ModelShape = field(repr=False)
    params: int
    tokens_per_step: int
    gpu_peak_bytes: int
    gpu_breakdown: dict[str, int]
    gpu_peak_phase: str
    gpu_phases: dict[str, int]
    host_peak_bytes: int
    host_breakdown: dict[str, int]
    disk_bytes: int
    max_batch_size: int | None
    max_batch_limit: str | None
    flops_per_step: float
    compute_s: float
    pcie_s: float
    update_s: float
    disk_s: float
    step_time_s: float
    eta: float
    binding: str
    critical_batch_size: int | None

    @property
    def engine_host_bytes(self) -> int:
        """Host bytes of the engine's own buffers (everything but the process baseline and NVMe staging)."""
        return sum(self.host_breakdown[key] for key in ENGINE_HOST_BUFFERS)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s if self.step_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every number, plus the inputs that produced them."""
        i = self.inputs
        return {
            "inputs": {
                "batch_size": i.batch_size,
                "seq_len": i.seq_len,
                "grad_accum": i.grad_accum,
                "compute_dtype_bytes": i.compute_dtype_bytes,
                "block_slots": i.block_slots,
                "gpu_memory_bytes": i.gpu_memory_bytes,
                "host_memory_bytes": i.host_memory_bytes,
                "offload_optimizer": i.offload_optimizer,
                "nvme_fraction": i.nvme_fraction,
                "offload_activations": i.offload_activations,
                "bandwidths": dataclasses.asdict(i.bandwidths),
                "fused_loss": i.fused_loss,
                "resident_units": list(i.resident_units),
            },
            "params": self.params,
            "tokens_per_step": self.tokens_per_step,
            "gpu_peak_bytes": self.gpu_peak_bytes,
            "gpu_peak_phase": self.gpu_peak_phase,
            "gpu_breakdown": dict(self.gpu_breakdown),
            "gpu_phases": dict(self.gpu_phases),
            "host_peak_bytes": self.host_peak_bytes,
            "host_breakdown": dict(self.host_breakdown),
            "disk_bytes": self.disk_bytes,
            "max_batch_size": self.max_batch_size,
            "max_batch_limit": self.max_batch_limit,
            "flops_per_step": self.flops_per_step,
            "compute_s": self.compute_s,
            "pcie_s": self.pcie_s,
            "update_s": self.update_s,
            "disk_s": self.disk_s,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "eta": self.eta,
            "binding": self.binding,
            "critical_batch_size": self.critical_batch_size,
        }


def make_plan(inputs: PlanInputs) -> Plan:
    """Plan memory and time for ``inputs``.

    Time, per optimizer step of T = batch x seq x grad_accum tokens (L blocks, S = seq, d = heads x
    head_dim, V x H the head matrix, N_b the block parameters):

    - compute = T x (8 N_b + 6 V H + 8 L S d) / gpu_tflops. Blocks run forward, recompute forward and
      backward: 2 + 2 + 4 = 8 FLOPs per parameter per token (6 without recompute). The head runs once
      with grad (6 V H). Attention: QK^T and AV are 4 S d per token per layer forward, halved by the
      causal mask, times the same four passes: 8 L S d.
    - pcie = max(h2d, d2h) (the directions are independent). h2d: 4 B/param per load (fp32 master, see
      ``_H2D_BYTES_PER_PARAM``); the embedding and head load once per step; blocks load once in each
      forward and backward, minus the ``block_slots`` still resident where the schedule turns around:
      accum x 2L - (2 accum - 1) x slots. d2h: every unit's gradient in the compute dtype per micro-batch
      (the embedding twice when the head is tied). Both add the activation stash (out and back in).
    - update = max(params / cpu_adam rate, (AdamW + accumulation bytes) / host memory bandwidth).
    - disk = bytes moved to and from NVMe (m and v read and written; stash written and read) / disk_gbps.

    step_time = max(compute, pcie, update, disk). eta = T_bwd / (T_d2h + T_update), with T_bwd the
    recompute + backward of the blocks plus the head (6 N_b + 6 L S d + 6 V H per token).
    """
    shape = inputs.shape
    gpu, phases = _gpu_bytes(shape, inputs)
    host = _host_bytes(shape, inputs)
    peak_phase = max(phases, key=phases.__getitem__) if phases else "none"
    gpu_breakdown = {**gpu, "workspace": phases.get(peak_phase, 0)}
    times = _times(shape, inputs)
    max_batch, limit = _max_batch(shape, inputs)
    return Plan(
        inputs=inputs,
        shape=shape,
        params=shape.params,
        tokens_per_step=inputs.batch_size * inputs.seq_len * inputs.grad_accum,
        gpu_peak_bytes=sum(gpu_breakdown.values()),
        gpu_breakdown=gpu_breakdown,
        gpu_peak_phase=peak_phase,
        gpu_phases=phases,
        host_peak_bytes=sum(host.values()),
        host_breakdown=host,
        disk_bytes=_disk_bytes(shape, inputs),
        max_batch_size=max_batch,
        max_batch_limit=limit,
        **times,
    )


# ---------------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------------
def _nvme_units(shape: ModelShape, inputs: PlanInputs) -> list[int]:
    """Numels of the units whose m and v live on NVMe."""
    if inputs.offload_optimizer != "nvme":
        return []
    ordered = [*shape.block_numels, shape.embedding_numel, shape.head_numel]
    count = math.floor(inputs.nvme_fraction * len(ordered) + 0.5)
    return ordered[:count]


def _accumulated_numel(shape: ModelShape, grad_accum: int) -> int:
    """Numel of the units that get an fp32 host accumulator: those with > 1 gradient contribution per
    step (every unit with accumulation; the embedding when the head borrows it)."""
    if grad_accum > 1:
        return shape.total_numel
    return shape.embedding_numel if shape.tied else 0


def _host_bytes(shape: ModelShape, inputs: PlanInputs) -> dict[str, int]:
    d = inputs.compute_dtype_bytes
    on_nvme = _nvme_units(shape, inputs)
    boundary = inputs.batch_size * inputs.seq_len * shape.hidden_size * d  # one block's input
    host = {
        "master_fp32": 4 * shape.total_numel,
        # device-resident units keep m and v on the GPU; their host ranges are never touched
        "optimizer_state": 8 * (shape.total_numel - sum(on_nvme) - _resident_numel(shape, inputs)),
        "grad_accumulators": 4 * _accumulated_numel(shape, inputs.grad_accum),
        "grad_ring": (
            shape.total_numel * d if inputs.clipping else _ring_slots(shape, inputs) * inputs.transfer_chunk_numel * d
        ),
        "activation_stash": shape.num_blocks * boundary if inputs.offload_activations == "ram" else 0,
        "optimizer_scratch": 4 * inputs.transfer_chunk_numel,
        # Double buffers in front of NVMe: one unit's m and v (or one block input) read ahead while the
        # previous one is in use.
        "nvme_staging": 2 * 8 * max(on_nvme, default=0) + (2 * boundary if inputs.offload_activations == "nvme" else 0),
        "process_baseline": PROCESS_BASELINE_BYTES,
    }
    return host


def _disk_bytes(shape: ModelShape, inputs: PlanInputs) -> int:
    state = 8 * sum(_nvme_units(shape, inputs))
    stash = 0
    if inputs.offload_activations == "nvme":
        stash = shape.num_blocks * inputs.batch_size * inputs.seq_len * shape.hidden_size * inputs.compute_dtype_bytes
    return state + stash


def _saved_elems_per_token(shape: ModelShape) -> int:
    """Elements autograd saves per token in one Llama-style block (SDPA attention, SwiGLU MLP).

    - two RMSNorms, each keeping its input and its fp32 normalised copy (counted in compute-dtype
      elements: H + 2H): 6H;
    - attention: q, k, v and the output for SDPA's backward (H + 2 kv + H), and the output again as
      o_proj's (reshaped, contiguous) input (H): 3H + 2 kv;
    - MLP: gate for SiLU, silu(gate) and up for the product, the product for down_proj: 4I.
    """
    h, kv, i = shape.hidden_size, shape.kv_dim, shape.intermediate_size
    return 9 * h + 2 * kv + 4 * i


def _ce_chunk_rows(tokens: int, vocab: int, dtype_bytes: int) -> int:
    """Rows of the fused head's logits chunk (mirrors ``linear_cross_entropy._chunk_rows``)."""
    rows = max(1, _CE_CHUNK_LOGITS_BYTES // max(1, vocab * dtype_bytes))
    if rows >= 128:
        rows -= rows % 128
    return max(1, min(rows, tokens))


def _gpu_bytes(shape: ModelShape, inputs: PlanInputs) -> tuple[dict[str, int], dict[str, int]]:
    """(persistent components, transient peak of each phase), in bytes."""
    d = inputs.compute_dtype_bytes
    tokens = inputs.batch_size * inputs.seq_len
    h, kv, i, v = shape.hidden_size, shape.kv_dim, shape.intermediate_size, shape.vocab_size
    slots = inputs.block_slots if shape.num_blocks else 0
    side_inputs = 3 * tokens * 8 + 2 * inputs.seq_len * shape.head_dim * d  # ids, labels, shifted; cos, sin
    resident = set(inputs.resident_units)
    persistent = {
        "block_slots": slots * 2 * shape.max_block_numel * d,
        "embedding_slot": 0 if "embedding" in resident else 2 * shape.embedding_numel * d,
        "head_slot": 0 if "head" in resident else 2 * shape.head_numel * d,
        "resident_units": _resident_bytes(shape, inputs),
        "activation_buffers": 2 * tokens * h * d,
        "model_extras": shape.extra_device_bytes + side_inputs,
        "cuda_context": CUDA_CONTEXT_BYTES,
    }
    # Fused: one reused (rows, vocab) chunk in the compute dtype. Eager: the logits, their fp32 upcast,
    # the fp32 log-softmax saved for backward and its gradient.
    logits = _ce_chunk_rows(tokens, v, d) * v * d if inputs.fused_loss else tokens * v * (d + 12)
    phases = {
        # no-grad block: input and output, plus the larger of attention's (normed x, q, k, v) and the
        # MLP's (gate, up, act) intermediates.
        "forward": tokens * (2 * h + max(2 * h + 2 * kv, 3 * i)) * d,
        # head: last hidden, normed hidden, its fp32 norm temporary, grad_h and grad_x; the logits
        # (above); the head-matrix gradient; per-token fp32 loss scalars.
        "head": tokens * h * (4 * d + 4) + logits + v * h * d + 2 * tokens * 4,
        # one block with grad: grad_out and grad_in, the saved tensors (x the calibration factor), and
        # the parameter gradients autograd returns before they are copied into the slot.
        "backward": int(_BLOCK_WORKSPACE_FACTOR * tokens * _saved_elems_per_token(shape) * d)
        + 2 * tokens * h * d
        + shape.max_block_numel * d,
        # embedding backward: grad_out and the dense (vocab, hidden) weight gradient.
        "embedding_backward": tokens * h * d + v * h * d,
    }
    if not shape.num_blocks:
        phases.pop("forward")
        phases.pop("backward")
    return persistent, phases


def _ring_slots(shape: ModelShape, inputs: PlanInputs) -> int:
    """The engine's rule (``EngineConfig.ring_slots``) over the host-updated units."""
    config = dataclasses.replace(
        _ENGINE_DEFAULTS, grad_ring_slots=inputs.grad_ring_slots, transfer_chunk_numel=inputs.transfer_chunk_numel
    )
    return config.ring_slots(shape.total_numel - _resident_numel(shape, inputs))


def _resident_numel(shape: ModelShape, inputs: PlanInputs) -> int:
    numel = {"embedding": shape.embedding_numel, "head": shape.head_numel}
    numel.update({f"block.{i}": n for i, n in enumerate(shape.block_numels)})
    return sum(numel.get(name, 0) for name in inputs.resident_units)


def _resident_bytes(shape: ModelShape, inputs: PlanInputs) -> int:
    """Device-resident units: params and grads in the compute dtype, fp32 master, m and v, and an fp32
    accumulator under gradient accumulation (see slide_core/engine/resident.py)."""
    per_param = 2 * inputs.compute_dtype_bytes + 12 + (4 if inputs.grad_accum > 1 or inputs.clipping else 0)
    numel = {"embedding": shape.embedding_numel, "head": shape.head_numel}
    numel.update({f"block.{i}": n for i, n in enumerate(shape.block_numels)})
    return sum(numel.get(name, 0) for name in inputs.resident_units) * per_param


def _gpu_peak(shape: ModelShape, inputs: PlanInputs) -> int:
    persistent, phases = _gpu_bytes(shape, inputs)
    return sum(persistent.values()) + max(phases.values(), default=0)


def _host_peak(shape: ModelShape, inputs: PlanInputs) -> int:
    return sum(_host_bytes(shape, inputs).values())


def largest_batch(
    inputs: PlanInputs, *, gpu_cap: int | None, host_cap: int | None, shape: ModelShape | None = None
) -> tuple[int | None, str | None]:
    """``(largest batch size whose peaks fit both caps, the cap that stops it: "gpu" | "host")``.

    ``(None, None)`` with no cap; ``(0, cap)`` when not even batch 1 fits. Both peaks grow with the
    batch, so a doubling search then bisection finds it in a few dozen arithmetic evaluations.
    """
    shape = shape or inputs.shape
    checks: list[tuple[str, Callable[[PlanInputs], int], int]] = []
    if gpu_cap is not None:
        checks.append(("gpu", lambda x: _gpu_peak(shape, x), gpu_cap))
    if host_cap is not None:
        checks.append(("host", lambda x: _host_peak(shape, x), host_cap))
    if not checks:
        return None, None

    def blocker(batch: int) -> str | None:
        trial = dataclasses.replace(inputs, batch_size=batch)
        return next((name for name, peak, cap in checks if peak(trial) > cap), None)

    if (first := blocker(1)) is not None:
        return 0, first
    low, high = 1, 2
    limit = 1 << 24
    while high <= limit and blocker(high) is None:
        low, high = high, high * 2
    if high > limit:
        return limit, None
    while high - low > 1:
        mid = (low + high) // 2
        if blocker(mid) is None:
            low = mid
        else:
            high = mid
    return low, blocker(high)


def _max_batch(shape: ModelShape, inputs: PlanInputs) -> tuple[int | None, str | None]:
    return largest_batch(inputs, gpu_cap=inputs.gpu_memory_bytes, host_cap=inputs.host_memory_bytes, shape=shape)


# ---------------------------------------------------------------------------------------------------
# time
# ---------------------------------------------------------------------------------------------------
def _block_loads(shape: ModelShape, inputs: PlanInputs) -> int:
    blocks = shape.num_blocks
    if not blocks:
        return 0
    resident = min(inputs.block_slots, blocks)
    return inputs.grad_accum * 2 * blocks - (2 * inputs.grad_accum - 1) * resident


def _times(shape: ModelShape, inputs: PlanInputs) -> dict[str, Any]:
    bw = inputs.bandwidths
    d = inputs.compute_dtype_bytes
    accum = inputs.grad_accum
    seq = inputs.seq_len
    tokens = inputs.batch_size * seq * accum
    layers = shape.num_blocks
    attn_dim = shape.num_heads * shape.head_dim
    head_matrix = shape.vocab_size * shape.hidden_size
    flops_per_token = 8 * shape.block_params + 6 * head_matrix + 8 * layers * seq * attn_dim
    bwd_flops_per_token = 6 * shape.block_params + 6 * head_matrix + 6 * layers * seq * attn_dim
    flops = float(tokens * flops_per_token)
    gpu_rate = bw.gpu_tflops * 1e12
    compute_s = flops / gpu_rate
    backward_s = tokens * bwd_flops_per_token / gpu_rate

    stash = layers * inputs.batch_size * seq * shape.hidden_size * d  # per micro-batch
    stash_pcie = stash * accum
    mean_block = sum(shape.block_numels) / layers if layers else 0.0
    loads = shape.embedding_numel + shape.head_numel + _block_loads(shape, inputs) * mean_block
    h2d_bytes = _H2D_BYTES_PER_PARAM * loads + stash_pcie
    grad_numel = shape.total_numel + (shape.embedding_numel if shape.tied else 0)
    d2h_grad_bytes = accum * grad_numel * d
    d2h_s = d2h_grad_bytes / (bw.d2h_gbps * 1e9)
    pcie_s = max(h2d_bytes / (bw.h2d_gbps * 1e9), (d2h_grad_bytes + stash_pcie) / (bw.d2h_gbps * 1e9))

    contributions = accum * grad_numel  # gradient chunks the optimizer thread receives, in elements
    accum_traffic = (contributions - shape.total_numel) * (8 + d) if contributions > shape.total_numel else 0
    host_traffic = shape.total_numel * (_ADAM_BYTES_PER_PARAM + d) + accum_traffic
    update_s = max(shape.total_numel / (bw.cpu_adam_gparams * 1e9), host_traffic / (bw.host_mem_gbps * 1e9))

    disk_traffic = 2 * 8 * sum(_nvme_units(shape, inputs))
    if inputs.offload_activations == "nvme":
        disk_traffic += 2 * stash * accum
    disk_s = disk_traffic / (bw.disk_gbps * 1e9)

    limits = {"gpu compute": compute_s, "pcie": pcie_s, "host memory bandwidth": update_s, "nvme": disk_s}
    binding = max(limits, key=limits.__getitem__)
    hide = d2h_s + update_s
    eta = backward_s / hide if hide > 0 else math.inf
    per_sample_bwd = backward_s / inputs.batch_size
    critical = math.ceil(hide / per_sample_bwd - 1e-9) if per_sample_bwd > 0 else None
    return {
        "flops_per_step": flops,
        "compute_s": compute_s,
        "pcie_s": pcie_s,
        "update_s": update_s,
        "disk_s": disk_s,
        "step_time_s": max(limits.values()),
        "eta": eta,
        "binding": binding,
        "critical_batch_size": max(1, critical) if critical is not None else None,
    }


# ---------------------------------------------------------------------------------------------------
# fitting
# ---------------------------------------------------------------------------------------------------
GPU_MARGIN_BYTES = 1 << 30
"""GPU memory left unplanned for allocator fragmentation and library workspaces."""


def plan_with_placement(inputs: PlanInputs) -> Plan:
    """The plan after spending the GPU budget's spare memory on device-resident units.

    Without a GPU budget nothing is placed. The units are chosen by
    :func:`slide_core.engine.placement.choose_resident_units` (embedding, head, then the first blocks).
    """
    import torch

    from slide_core.engine.placement import choose_resident_units

    base = make_plan(inputs)
    if inputs.gpu_memory_bytes is None or isinstance(inputs.model, ModelShape):
        return base
    spare = max(0, inputs.gpu_memory_bytes - base.gpu_peak_bytes - GPU_MARGIN_BYTES)
    dtype = torch.float32 if inputs.compute_dtype_bytes == 4 else torch.bfloat16
    accumulates = inputs.grad_accum > 1 or inputs.clipping
    resident = choose_resident_units(inputs.model, spare, dtype, accumulates=accumulates)
    return make_plan(dataclasses.replace(inputs, resident_units=resident)) if resident else base


def available_host_bytes() -> int:
    """Host RAM a new training process can take without swapping: the kernel's ``MemAvailable``.

    Not ``available + this process's RSS``: the run being planned is a separate (``slide train``)
    process, and the planning process itself is small.
    """
    return int(psutil.virtual_memory().available)


def check_fits(
    plan: Plan,
    *,
    host_available: int | None,
    gpu_available: int | None,
    gpu_source: str = "allowed by --gpu-memory",
) -> None:
    """Raise :class:`UserError` (one line, with the fix to try) when ``plan`` exceeds a budget.

    A None budget is not checked. ``gpu_source`` says where the GPU budget came from.
    """
    problems = []
    inputs, shape = plan.inputs, plan.shape
    if gpu_available is not None and plan.gpu_peak_bytes > gpu_available:
        best, _ = largest_batch(inputs, gpu_cap=gpu_available, host_cap=None, shape=shape)
        if best:
            hint = f"try a smaller --batch-size (largest that fits: {best})"
        elif inputs.block_slots > 1:
            hint = "not even --batch-size 1 fits; try --block-slots 1 or a shorter --seq-len"
        else:
            hint = "not even --batch-size 1 fits; try a shorter --seq-len or a larger GPU"
        problems.append(
            f"needs {format_bytes(plan.gpu_peak_bytes)} GPU memory, {format_bytes(gpu_available)} {gpu_source}; {hint}"
        )
    if host_available is not None and plan.host_peak_bytes > host_available:
        problems.append(
            f"needs {format_bytes(plan.host_peak_bytes)} host RAM, {format_bytes(host_available)} available; "
            + _host_hint(inputs, shape, host_available)
        )
    if problems:
        raise UserError("; also ".join(problems))


def _host_hint(inputs: PlanInputs, shape: ModelShape, available: int) -> str:
    """The first change (cumulative, cheapest first) that makes the host side fit."""
    steps: list[tuple[str, dict[str, Any]]] = []
    if inputs.offload_optimizer == "ram":
        steps.append(("--offload-optimizer nvme", {"offload_optimizer": "nvme", "nvme_fraction": 1.0}))
    elif inputs.nvme_fraction < 1.0:
        steps.append(("--nvme-fraction 1", {"nvme_fraction": 1.0}))
    if inputs.offload_activations == "ram":
        steps.append(("--offload-activations nvme", {"offload_activations": "nvme"}))
    flags: list[str] = []
    changes: dict[str, Any] = {}
    for flag, change in steps:
        flags.append(flag)
        changes.update(change)
        if _host_peak(shape, dataclasses.replace(inputs, **changes)) <= available:
            return "try " + " ".join(flags)
    trial = dataclasses.replace(inputs, **changes)
    best, _ = largest_batch(trial, gpu_cap=None, host_cap=available, shape=shape)
    if best and best < inputs.batch_size:
        return "try " + " ".join([*flags, f"--batch-size {best}"])
    floor = _host_peak(shape, dataclasses.replace(trial, batch_size=1))
    with_flags = f" even with {' '.join(flags)}" if flags else ""
    return f"the model alone needs {format_bytes(floor)}{with_flags}; use a machine with more RAM"


# ---------------------------------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------------------------------
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, *, what: str = "size") -> int:
    """``"24GiB"`` -> 25769803776. Accepts B, KB/KiB, MB/MiB, GB/GiB, TB/TiB (any case; GB = 1e9,
    GiB = 2**30), decimals (``1.5GiB``) and plain byte counts. ``what`` names the option in the error."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise UserError(f"{what}: cannot read {text!r} as a size; use e.g. 24GiB, 80GB, 512MiB or a byte count")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(f"{what}: size must be positive, got {text!r}")
    return value


def format_bytes(n: int | float) -> str:
    """Binary units, one decimal: ``30.1 GiB``, ``512.0 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
