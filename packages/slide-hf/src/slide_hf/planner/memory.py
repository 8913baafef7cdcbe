"""Bytes: what a run holds in host RAM, on the GPU and on NVMe, as a function of its :class:`PlanInputs`.

Every buffer the engine allocates is priced by its owner (:func:`engine_buffers`): the master
(``HostParameters.bytes_for``, with the page-locked spans of :func:`master_bytes`), the optimizer state and
the gradient accumulators (``HostState``), the gradient ring or store (``GradTransfer.host_bytes``), the
activation stash and its device buffers (``ActivationStash``), the optimizer's host and device scratch
(``Optimizer.host_scratch_bytes``, ``device_scratch_bytes``), the gradient norms (``UnitNorms``), the NVMe
staging sets (``OffloadedState.staging_bytes``), the tiers' own slab or bounce buffers
(``Tier.host_bytes_for``), the slots (``SlotWindow.slot_bytes``), the device-resident
units (``resident_numel_bytes``), the resident pipeline's scratch and the upload's cast chunk
(``MasterUpload.staging_bytes``). The planner supplies the model's shapes and the run's options, never its own
formula for an engine buffer; ``tests/hf/test_planner_buffers.py`` checks each against what a real engine
allocates, buffer by buffer. The process baseline and the GPU's transient workspace are estimates from the
model's shapes.

The GPU peak is the persistent part (parameter/gradient slots, the two activation buffers, the CUDA
context, device-resident units and the scratch their updates hold, the latter as the optimizer and the
resident pipeline report it rather than derived here) plus the largest transient of the four phases of a micro-batch: the no-grad forward of one
block, the head (slide-kernels' chunked linear + cross-entropy, or HF's full logits without it), the
recomputed backward of one block, and the embedding backward. Only one runs at a time, so they do not add.
The backward is priced from what the costliest block's forward saves for autograd, measured on the meta
device for the model's own layers (:mod:`slide_hf.planner.activations`), with a formula only where
that cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slide_core.collectives import shard_span
from slide_core.engine.activations import TIER_STAGING_COPIES, ActivationStash
from slide_core.engine.host_span import pinned_spans
from slide_core.engine.host_state import HostState
from slide_core.engine.master_upload import MasterUpload
from slide_core.engine.resident import resident_numel_bytes
from slide_core.engine.resident_pipeline import ResidentPipeline
from slide_core.host_params import HostParameters
from slide_core.optim.adamw_config import AdamWConfig
from slide_core.optimizer import Optimizer
from slide_core.tier import TierRequest
from slide_hf.offload import state_tier_capacity
from slide_hf.planner.attention_masks import attention_masks
from slide_hf.planner.inputs import ModelShape, PlanInputs
from slide_hf.planner.seq_tiles import engaged_tile, mlp_tokens, tiled_saved_bytes, tiling_buffer_bytes

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "ENGINE_DEVICE_BUFFERS",
    "ENGINE_HOST_BUFFERS",
    "GPU_RUNTIME_HOST_BYTES",
    "PROCESS_BASELINE_BYTES",
    "EngineBuffers",
    "GiB",
    "engine_buffers",
    "master_bytes",
    "pinned_master_numel",
]

GiB = 1 << 30

PROCESS_BASELINE_BYTES = 1 * GiB
"""Resident memory of a training process before any engine buffer: Python, torch, transformers and the
meta-device model. Measured on CPU at ~0.5 GB (``tests/hf/test_planner.py`` checks it stays below this);
a CUDA build adds the host side of the CUDA runtime and cuBLAS, hence the round 1 GiB."""

GPU_RUNTIME_HOST_BYTES = 2 * GiB
"""Host memory a run on a GPU adds to :data:`PROCESS_BASELINE_BYTES` before its first engine buffer: the host
side of the CUDA context, cuBLAS, cuDNN and Triton's loaded kernels. Measured on an H200 host (torch 2.11,
CUDA 13): over 20 `slide bench` processes of 5-50 GiB each, the host peak exceeded the engine's buffers and
the 1 GiB baseline by 0.35 to 2.0 GiB (median 1.35; the largest where numba compiled the int8 kernels in the
run). Planned only for an accelerator (``PlanInputs.accelerator``)."""

CUDA_CONTEXT_BYTES = 512 << 20
"""GPU memory the CUDA context and cuBLAS workspaces take before the first tensor (~0.5 GB on H100/H200)."""

_BLOCK_WORKSPACE_FACTOR = 1.45
"""Peak GPU bytes of one block's recompute + backward over the bytes its forward saves for autograd
(:func:`_block_saved_bytes`). The excess over 1 is the backward's transient gradients: those of the
largest intermediates (the MLP's ``act * up``, ``gate`` and ``up``; a delta net's chunk states), alive
beside the saved tensors. Derived from H200 peaks (``torch.cuda.max_memory_allocated`` of ``slide bench
--gpu-memory 24 --batch-size 16 --seq-len 1024``, with the resident units that run had) against the
measured saved bytes: Llama-3.1-8B 20.35 GiB, GLM-4-9B cut to 20 layers 22.69 GiB and Moonlight-16B-A3B
cut to 9 layers 21.94 GiB need 1.40, 1.41 and 1.26 to be priced at or above them; 1.45 prices them at
20.51, 22.86 and 22.62 GiB (+1% to +3%)."""

_CE_CHUNK_LOGITS_BYTES = 256 << 20
"""``slide_kernels.ops.linear_cross_entropy.CHUNK_LOGITS_BYTES``: the fused head's one (rows, vocab)
logits buffer. Copied, not imported, so planning never imports triton."""

ENGINE_HOST_BUFFERS = (
    "master_fp32",
    "optimizer_state",
    "grad_accumulators",
    "grad_ring",
    "activation_stash",
    "optimizer_scratch",
    "grad_norms",
)
"""Keys of ``Plan.host_breakdown`` that are buffers the engine itself allocates in RAM (its NVMe staging,
``nvme_staging``, is one too, kept apart as the planner always has)."""

ENGINE_DEVICE_BUFFERS = (
    "block_slots",
    "embedding_slot",
    "head_slot",
    "resident_units",
    "resident_scratch",
    "streamed_staging",
    "h2d_staging",
    "activation_buffers",
    "grad_norms",
)
"""Keys of ``Plan.gpu_breakdown`` that are buffers the engine itself allocates on the device."""


@dataclass(frozen=True)
class EngineBuffers:
    """Every buffer the engine allocates for one configuration, by name, as its owner reports it: ``host``
    (RAM, including ``nvme_staging``) and ``device``. What :func:`_host_bytes` and :func:`_gpu_bytes` sum."""

    host: dict[str, int]
    device: dict[str, int]

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {"host": dict(self.host), "device": dict(self.device)}


def _host_optimizer(inputs: PlanInputs) -> Optimizer:
    """The run's optimizer, or the shipped one for ``optimizer_state`` whose host scratch is the largest
    (the torch ops: the numba kernels keep less)."""
    if inputs.optimizer is not None:
        return inputs.optimizer
    from slide_core.optim import TorchAdamW
    from slide_core.optim.compact_adamw import CompactAdamW

    config = AdamWConfig(state_format=inputs.optimizer_state)
    return TorchAdamW(config) if inputs.optimizer_state == "fp32" else CompactAdamW(config, fused=False)


def engine_buffers(shape: ModelShape, inputs: PlanInputs, world_size: int = 1) -> EngineBuffers:
    """Every engine buffer of this configuration, each priced by the class that allocates it.

    Which units are host-updated, on NVMe, streamed or resident, and which get an accumulator, is the run's
    layout (slide_core's :class:`~slide_core.engine.layout.RunLayout`, built from the engine config the
    run itself is built with, :meth:`PlanInputs.engine_config`); the bytes each buffer takes are its
    owner's answer. The tiers' own host buffers (a tier in memory's slab, a tier on disk's bounce
    buffers) are their classes' answer (``Tier.host_bytes_for``).

    ``world_size``: the buffers of one of that many data-parallel ranks, the one that holds the most
    (its shards of the master, the state, the accumulators and the ring or store; the rest as one
    process): what each rank's engine counts (``Engine.host_allocations``)."""
    layout = inputs.layout(shape)
    d = inputs.compute_dtype_bytes
    arrays = inputs.state_arrays()
    boundary = inputs.batch_size * inputs.seq_len * shape.activation_width  # one block's input, in elements
    stash_copies = shape.num_blocks if inputs.offload_activations == "ram" else 0
    tier_copies = TIER_STAGING_COPIES if inputs.offload_activations == "nvme" else 0
    laid_out = layout.host_buffers(arrays, inputs.grad_accum, world_size)
    state_tier_in_ram, tiers_on_disk = _tier_host_bytes(shape, inputs)
    host = {
        # device-resident units' host ranges are given back once on the GPU (Note [Resident host copies]),
        # but for those inside a page-locked span (Note [One registration per allocation])
        "master_fp32": master_bytes(shape, inputs, world_size),
        # device-resident and NVMe units keep m and v elsewhere; their host ranges are never touched
        # a tier in memory (pinned) keeps its units' state on the host too, in a slab of its own
        "optimizer_state": laid_out["optimizer_state"] + state_tier_in_ram,
        "grad_accumulators": laid_out["grad_accumulators"],
        "grad_ring": laid_out["grad_ring"],
        "activation_stash": ActivationStash.host_bytes_for(stash_copies, boundary, d),
        "optimizer_scratch": _host_optimizer(inputs).host_scratch_bytes(
            inputs.transfer_chunk_numel, corrects=inputs.clipping, split_master=inputs.master_format == "split"
        )
        if layout.host_steps
        else 0,
        "grad_norms": laid_out["grad_norms"],
        # Double buffers in front of NVMe: one unit's m and v (or one block input) read ahead while the
        # previous one is in use; and the tiers' own bounce buffers.
        "nvme_staging": laid_out["state_tier_staging"]
        + ActivationStash.host_bytes_for(tier_copies, boundary, d)
        + tiers_on_disk,
    }
    slots_and_norms = layout.device_buffers()
    norms = slots_and_norms.pop("grad_norms")
    device = {
        **slots_and_norms,
        "resident_units": _resident_bytes(shape, inputs),
        "resident_scratch": _resident_scratch_bytes(shape, inputs),
        "streamed_staging": streamed_staging_bytes(shape, inputs),
        "h2d_staging": _h2d_staging_bytes(shape, inputs),
        "activation_buffers": ActivationStash.device_bytes_for(boundary, d),
        "grad_norms": norms,
    }
    return EngineBuffers(host, device)


def master_bytes(shape: ModelShape, inputs: PlanInputs, world_size: int = 1) -> int:
    """The host master one of ``world_size`` ranks holds while it trains (the largest over the ranks):
    every plane of its shards of the host-updated units (Note [Sharded master] in slide_core's
    engine/host_pipeline.py), and in the plane the host-to-device copy reads, the spans the engine
    page-locks (:func:`pinned_master_numel`), with the resident units inside them."""
    master_format = inputs.master_format
    resident = set(inputs.resident_units)
    host_numel = sum(n for name, n in shape.named_numels.items() if name not in resident)
    copied_plane = HostParameters.h2d_bytes_for(host_numel, master_format)
    other_planes = (
        HostParameters.bytes_for(host_numel, master_format) - copied_plane
    )  # a split master's low and tie bits
    pinned = max(pinned_master_numel(shape, inputs, rank, world_size) for rank in range(world_size))
    return other_planes // world_size + HostParameters.h2d_bytes_for(pinned, master_format)


def pinned_master_numel(shape: ModelShape, inputs: PlanInputs, rank: int = 0, world_size: int = 1) -> int:
    """Elements of the copied plane that rank ``rank`` of ``world_size`` page-locks, by the engine's rule
    (``slide_core.engine.host_span.pinned_spans``, units laid out in model order): its shards of the
    host-updated units, and the resident units between two of them with nothing else in the gap (in one
    process, every resident unit between the first host-updated unit and the last)."""
    resident = set(inputs.resident_units)
    extents, bridges, offset = [], [], 0
    for name, numel in shape.named_numels.items():
        if name in resident:
            bridges.append((offset, offset + numel))
        else:
            lo, hi = shard_span(numel, rank, world_size)
            extents.append((offset + lo, offset + hi))
        offset += numel
    return sum(end - start for start, end in pinned_spans(extents, bridges))


def _tier_host_bytes(shape: ModelShape, inputs: PlanInputs) -> tuple[int, int]:
    """``(state tier in memory, tiers on disk)``: the host bytes the run's tiers hold of their own, each
    asked of its class for the request the run opens it with (slide_hf/setup.py). A state tier in memory
    (``pinned``) holds its units' state, as stored, at least (a tier that allocates key by key says
    nothing up front); a tier on disk holds its bounce buffers."""
    in_ram = on_disk = 0
    numel = shape.named_numels
    stored = [numel[name] for name in inputs.offloaded_units]
    if stored and inputs.offload_optimizer != "nvme":
        state = HostState.state_bytes(inputs.state_arrays(), stored)
        tier = inputs.state_tier_class
        capacity = state_tier_capacity(inputs.state_arrays(), stored)
        in_ram = max(state, tier.host_bytes_for(TierRequest(capacity_bytes=capacity)) if tier is not None else 0)
    elif stored and inputs.state_tier_class is not None:
        capacity = state_tier_capacity(inputs.state_arrays(), stored)
        on_disk += inputs.state_tier_class.host_bytes_for(TierRequest(capacity_bytes=capacity))
    if inputs.offload_activations == "nvme" and inputs.activation_tier_class is not None:
        on_disk += inputs.activation_tier_class.host_bytes_for(TierRequest())
    return in_ram, on_disk


def _nvme_units(shape: ModelShape, inputs: PlanInputs) -> list[int]:
    """Numels of the units whose m and v live on NVMe (:attr:`PlanInputs.offloaded_units` on a tier that keeps
    files)."""
    if inputs.offload_optimizer != "nvme":
        return []
    numels = shape.named_numels
    return [numels[name] for name in inputs.offloaded_units]


def _host_bytes(shape: ModelShape, inputs: PlanInputs) -> dict[str, int]:
    host = dict(engine_buffers(shape, inputs).host)
    host["process_baseline"] = PROCESS_BASELINE_BYTES
    host["gpu_runtime_host"] = GPU_RUNTIME_HOST_BYTES if inputs.accelerator else 0
    return host


def _disk_bytes(shape: ModelShape, inputs: PlanInputs) -> int:
    state = HostState.state_bytes(inputs.state_arrays(), _nvme_units(shape, inputs))  # the tier keeps them as stored
    stash = 0
    if inputs.offload_activations == "nvme":
        stash = (
            shape.num_blocks * inputs.batch_size * inputs.seq_len * shape.activation_width * inputs.compute_dtype_bytes
        )
    return state + stash


def _block_saved_bytes(shape: ModelShape, inputs: PlanInputs) -> int:
    """Bytes autograd saves in the costliest block of the model for one micro-batch.

    Measured on the meta device for each kind of block (:mod:`slide_hf.planner.activations`: one
    sequence at this sequence length, times the batch); a kind that cannot run there, and a shape
    without a measurer (filled by hand, a non-HF model), take the formula
    (:func:`_saved_elems_per_token`). With the MLPs tiled (``--seq-tile``), what the tiled blocks save plus
    one tile's share of the MLPs' intermediates (slide_hf/planner/seq_tiles.py).
    """
    untiled = _saved_by_kind(shape, inputs, tiled=False)
    if not engaged_tile(inputs):
        return max(untiled)
    tiled = _saved_by_kind(shape, inputs, tiled=True)
    return max(tiled_saved_bytes(t, u, inputs) for t, u in zip(tiled, untiled, strict=True))


def _saved_by_kind(shape: ModelShape, inputs: PlanInputs, *, tiled: bool) -> list[int]:
    """Bytes each kind of block saves for one micro-batch (:func:`_block_saved_bytes`)."""
    tokens = inputs.batch_size * inputs.seq_len
    formula = tokens * _saved_elems_per_token(shape, mlp=not tiled) * inputs.compute_dtype_bytes
    if shape.activations is None:
        return [formula]
    dtype = torch.float32 if inputs.compute_dtype_bytes == 4 else torch.bfloat16
    measured = shape.activations.saved_bytes(inputs.seq_len, dtype, tiled=tiled)
    return [formula if per_sequence is None else inputs.batch_size * per_sequence for per_sequence in measured.values()]


def _saved_elems_per_token(shape: ModelShape, *, mlp: bool = True) -> int:
    """Elements autograd saves per token in one Llama-style block (SDPA attention, SwiGLU MLP): the
    fallback where a block cannot be measured (:func:`_block_saved_bytes`).

    - two RMSNorms, each keeping its input and its fp32 normalised copy (counted in compute-dtype
      elements: H + 2H): 6H;
    - attention: q, k, v and the output for SDPA's backward (H + 2 kv + H), and the output again as
      o_proj's (reshaped, contiguous) input (H): 3H + 2 kv;
    - MLP: gate for SiLU, silu(gate) and up for the product, the product for down_proj: 4I (none when
      ``mlp`` is False: a tiled MLP saves only its input, slide_hf/adapters/tiled_mlp.py).
    """
    h, kv, i = shape.hidden_size, shape.kv_dim, shape.intermediate_size
    return 9 * h + 2 * kv + (4 * i if mlp else 0)


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
    w = shape.activation_width  # what units pass each other: h unless the model widens it
    side_inputs = 3 * tokens * 8 + 2 * inputs.seq_len * shape.head_dim * d  # ids, labels, shifted; cos, sin
    masks = attention_masks(inputs)  # (S x S) masks where the attention needs them (attention_masks.py)
    persistent = {
        **engine_buffers(shape, inputs).device,
        "model_extras": shape.extra_device_bytes + side_inputs,
        "cuda_context": CUDA_CONTEXT_BYTES,
    }
    if masks.held_bytes:
        persistent["attention_masks"] = masks.held_bytes
    # Fused: one reused (rows, vocab) chunk in the compute dtype. Eager: the logits, their fp32 upcast,
    # the fp32 log-softmax saved for backward and its gradient.
    logits = _ce_chunk_rows(tokens, v, d) * v * d if inputs.fused_loss else tokens * v * (d + 12)
    phases = {
        # no-grad block: input and output, plus the larger of attention's (normed x, q, k, v) and the
        # MLP's (gate, up, act) intermediates, of one tile where the MLP is tiled.
        "forward": (tokens * 2 * w + max(tokens * (2 * h + 2 * kv), mlp_tokens(inputs) * 3 * i)) * d + masks.call_bytes,
        # head: last hidden, normed hidden, its fp32 norm temporary, grad_h and grad_x (the last block's
        # output and its gradient at the stream's width); the logits (above); per-token fp32 loss scalars;
        # without the fused loss, the head-matrix gradient (the fused loss writes it straight into the
        # slot's gradient buffer: Unit.grads_in_forward).
        "head": tokens * (h * (4 * d + 4) + 2 * (w - h) * d)
        + logits
        + (0 if inputs.fused_loss else v * h * d)
        + 2 * tokens * 4,
        # one block with grad: grad_out and grad_in, the saved tensors (x the transient gradients'
        # factor), and the parameter gradients autograd returns before they are copied into the slot;
        # with a tiled MLP, its own buffers (slide_hf/planner/seq_tiles.py).
        "backward": int(_BLOCK_WORKSPACE_FACTOR * _block_saved_bytes(shape, inputs))
        + 2 * tokens * w * d
        + shape.max_block_numel * d
        + tiling_buffer_bytes(shape, inputs)
        + masks.call_bytes,
        # embedding backward: grad_out and the dense (vocab, hidden) weight gradient.
        "embedding_backward": tokens * w * d + v * h * d,
    }
    if not shape.num_blocks:
        phases.pop("forward")
        phases.pop("backward")
    return persistent, phases


def _h2d_staging_bytes(shape: ModelShape, inputs: PlanInputs) -> int:
    """The uploads' cast buffers (slide_core/engine/master_upload.py reports the size of one). Each host
    pipeline that streams units keeps its own (slide_core/engine/unit_pipelines.py): the one of the units
    whose state is in RAM, and the one of those whose state is on the tier (``OffloadedPipeline``)."""
    resident, on_tier = set(inputs.resident_units), set(inputs.offloaded_units)
    streamed = [name for name in shape.named_numels if name not in resident]
    uploads = int(any(name not in on_tier for name in streamed)) + int(bool(on_tier))
    source = 2 if inputs.master_format == "split" else 4  # the split master's bf16 plane, or the fp32 master
    return uploads * MasterUpload.staging_bytes(inputs.transfer_chunk_numel, source, inputs.compute_dtype_bytes)


def _resident_bytes(shape: ModelShape, inputs: PlanInputs) -> int:
    """Device-resident units, priced by the engine's own rule (slide_core/engine/resident.py) with the
    state arrays the run's optimizer stores (bf16 or int8 moments take less than fp32 ones)."""
    accumulates = inputs.grad_accum > 1  # clipping sums a tied embedding in its slot too (resident.py)
    numel = shape.named_numels
    arrays = inputs.device_optimizer().state_arrays
    return sum(
        resident_numel_bytes(numel[name], inputs.compute_dtype_bytes, accumulates=accumulates, state_arrays=arrays)
        for name in inputs.resident_units
        if name in numel
    )


def streamed_staging_bytes(shape: ModelShape, inputs: PlanInputs) -> int:
    """GPU bytes of the GPU-streamed updates (``EngineConfig.streamed_units``), as their owners report
    them (``unit_costs.staging_price``): the staging sets of ``StreamedPipeline.device_bytes``
    (``PlanInputs.staging_sets``, each one unit's fp32 master or a split master's planes and the moments
    as stored, sized by the largest streamed unit, plus a split master's one fp32 buffer), the pool of fp32
    summed gradients for the streamed units that get several contributions a step (one per such unit in
    flight, Note [One sum per summing unit in flight] in slide_core/engine/sums_pool.py) and the device
    optimizer's scratch for its ranges. The grad ring prices the host-updated units alone, as the engine
    sizes it (Note [The ring is sized for the host's units] in grad_transfer.py); the clipping store still
    prices every unit that is not resident. The units a run may move to the streamed update between steps
    (``PlanInputs.streamable_units``) size the staging as the streamed ones do: the engine builds it for
    them from the start (Note [Re-placement at a step boundary] in slide_core/engine/replacement.py)."""
    from slide_hf.planner.unit_costs import staging_price

    return staging_price(shape, inputs)({*inputs.streamed_units, *inputs.streamable_units})


def _resident_max_numel(shape: ModelShape, inputs: PlanInputs) -> int:
    numel = shape.named_numels
    return max((numel.get(name, 0) for name in inputs.resident_units), default=0)


def resident_scratch_bytes(inputs: PlanInputs, max_unit_numel: int) -> int:
    """The GPU scratch of updating resident units of up to ``max_unit_numel`` elements, as its owners
    report it: the optimizer's device replica (``Optimizer.device_scratch_bytes``; the engine hands it
    ranges of at most a unit) and the resident pipeline's own (``ResidentPipeline.scratch_bytes``). Held
    from the first update on, so it is priced as persistent."""
    if max_unit_numel <= 0:
        return 0
    chunk, clipping = inputs.transfer_chunk_numel, inputs.clipping
    longest = ResidentPipeline.optimizer_range_numel(max_unit_numel, chunk, clipping=clipping)
    optimizer = inputs.device_optimizer().device_scratch_bytes(longest, corrects=clipping)
    pipeline = ResidentPipeline.scratch_bytes(max_unit_numel, inputs.transfer_chunk_numel, clipping=inputs.clipping)
    return optimizer + pipeline


def _resident_scratch_bytes(shape: ModelShape, inputs: PlanInputs) -> int:
    return resident_scratch_bytes(inputs, _resident_max_numel(shape, inputs))


def _gpu_peak(shape: ModelShape, inputs: PlanInputs) -> int:
    persistent, phases = _gpu_bytes(shape, inputs)
    return sum(persistent.values()) + max(phases.values(), default=0)


def _host_peak(shape: ModelShape, inputs: PlanInputs) -> int:
    """The larger of training (the breakdown) and loading, when the whole fp32 master is on the host
    before the engine hands the resident units' copies to the GPU. The process is the same one in both phases,
    so loading carries the same baseline and, on a GPU, the CUDA runtime's host side: it is up by the time
    the resident units are copied (a model whose units all fit the GPU peaks here, not in training; on an
    H200, Granite-3.3-8B and SmolLM3-3B cut to 4 layers ran 1.6-2.1 GiB past a loading term without it)."""
    host = _host_bytes(shape, inputs)
    loading = 4 * shape.total_numel + host["process_baseline"] + host["gpu_runtime_host"]
    return max(sum(host.values()), loading)
