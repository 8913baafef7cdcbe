"""Seconds: the step time of a :class:`PlanInputs`, its binding pipeline, overlap and the critical batch.

Step time assumes perfect overlap of the pipelines the engine runs concurrently (GPU compute, PCIe in
each direction, the CPU optimizer, NVMe when used) and takes the slowest; see
:func:`slide_hf.planner.make_plan` for each formula. It is a planning number (within tens of percent),
not a benchmark.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slide_core.optim.state_formats import state_bytes_per_param
from slide_hf.planner.inputs import ModelShape, PlanInputs
from slide_hf.planner.memory import _nvme_units
from slide_hf.planner.step_schedule import ScheduleRates, UnitWork, simulate_step
from slide_hf.planner.traffic import h2d_bytes_per_param
from slide_hf.planner.unit_costs import (
    STREAMED_MASTER_BYTES,
    UnitCost,
    fixed_times,
    placement_of,
    resource_times,
    unit_costs,
)

__all__: list[str] = []


def _times(shape: ModelShape, inputs: PlanInputs) -> dict[str, Any]:
    d = inputs.compute_dtype_bytes
    accum = inputs.grad_accum
    seq = inputs.seq_len
    tokens = inputs.batch_size * seq * accum
    layers = shape.num_blocks
    attn_dim = shape.num_heads * shape.head_dim
    head_matrix = shape.vocab_size * shape.hidden_size
    head_passes = _head_flops_per_param(inputs)
    flops_per_token = 8 * shape.block_params + head_passes * head_matrix + 8 * layers * seq * attn_dim
    bwd_flops_per_token = 6 * shape.block_params + 6 * head_matrix + 6 * layers * seq * attn_dim
    flops = float(tokens * flops_per_token)
    gpu_rate = inputs.bandwidths.gpu_tflops * 1e12
    compute_s = flops / gpu_rate
    backward_s = tokens * bwd_flops_per_token / gpu_rate

    disk_traffic = 2 * state_bytes_per_param(inputs.optimizer_state) * sum(_nvme_units(shape, inputs))
    if inputs.offload_activations == "nvme":
        disk_traffic += 2 * layers * inputs.batch_size * seq * shape.activation_width * d * accum
    disk_s = disk_traffic / (inputs.bandwidths.disk_gbps * 1e9)

    costs = unit_costs(shape, inputs)
    placements = {cost.name: placement_of(cost.name, inputs) for cost in costs}
    fixed = fixed_times(shape, inputs, compute_s, disk_s)
    resources = resource_times(fixed, costs, placements)
    pcie_s = max(resources["pcie h2d"], resources["pcie d2h"], resources["pcie duplex"])
    update_s = max(resources["cpu"], resources["host memory"])
    binding = max(resources, key=resources.__getitem__)  # the resource whose line is the largest
    scheduled_s = scheduled_step_s(shape, inputs, costs, placements)
    clipped_s = None
    if inputs.clipping:  # Note [Deferred steps] in step_schedule.py: a step after one that clipped
        deferred = {name: "host" if where == "streamed" else where for name, where in placements.items()}
        deferred_resources = resource_times(fixed, costs, deferred)
        clipped_s = max(scheduled_step_s(shape, inputs, costs, deferred, deferred=True), *deferred_resources.values())
    # What the backward must hide: the host-updated units' gradients going out and their updates.
    d2h_s = sum(cost.host["pcie d2h"] for cost in costs if placements[cost.name] == "host")
    hide = d2h_s + update_s
    overlap = backward_s / hide if hide > 0 else math.inf
    per_sample_bwd = backward_s / inputs.batch_size
    critical = math.ceil(hide / per_sample_bwd - 1e-9) if per_sample_bwd > 0 else None
    reference_s = _reference_step_s(shape, inputs, placements) if inputs.objective == "dpo" else None
    return {
        "reference_step_s": reference_s,
        "flops_per_step": flops,
        "compute_s": resources["gpu compute"],
        "pcie_s": pcie_s,
        "update_s": update_s,
        "disk_s": resources["nvme"],
        # The schedule leaves resources out (host memory, NVMe) or approximates them (both PCIe directions
        # at once, the host optimizer at its busy rate): each one's time bounds the step, so the step is
        # never shorter than a resource it runs on.
        "step_time_s": max(scheduled_s, *resources.values()),
        "clipped_step_time_s": clipped_s,
        "resource_bound_s": max(resources.values()),
        "overlap": overlap,
        "binding": binding,
        "critical_batch_size": max(1, critical) if critical is not None else None,
        "resource_s": resources,
    }


def _head_flops_per_param(inputs: PlanInputs) -> int:
    """FLOPs per head-matrix parameter and token of a step: the fused cross-entropy's forward and backward
    (2 + 4); a preference head's log-probabilities without grad run the matmul once more (+2, Note
    [Preference loss through a weighted cross-entropy] in slide_hf/preference/head.py)."""
    return 8 if inputs.preference else 6


def _reference_step_s(shape: ModelShape, inputs: PlanInputs, placements: Mapping[str, str]) -> float:
    """DPO's reference pass over one step's worth of pairs: a forward of every micro-batch through the
    engine's evaluation path, the head computing log-probabilities only (2 FLOPs per parameter and token,
    the attention's 4 per layer), each sliding unit's weights loaded once per micro-batch; the larger of
    the GPU's compute and the h2d loads, which overlap."""
    pass_ = reference_pass(shape, inputs, placements)
    return max(pass_.compute_s, pass_.load_bytes / (inputs.bandwidths.h2d_gbps * 1e9))


@dataclass(frozen=True)
class ReferencePass:
    """DPO's reference pass over one rank's step's worth of pairs, in parts a data-parallel plan rescales
    (slide_hf/planner/distributed.py): the GPU's forward compute, the bytes its loads copy up, and the
    weights (parameters) those loads carry through the units."""

    compute_s: float
    load_bytes: float
    loaded_params: float


def reference_pass(shape: ModelShape, inputs: PlanInputs, placements: Mapping[str, str]) -> ReferencePass:
    """The parts of :func:`_reference_step_s`: each sliding unit (any placement but resident) loaded once
    per group of micro-batches (:func:`eval_group_size`)."""
    seq = inputs.seq_len
    tokens = inputs.batch_size * seq * inputs.grad_accum
    attn_dim = shape.num_heads * shape.head_dim
    head_matrix = shape.vocab_size * shape.hidden_size
    flops = tokens * (2 * shape.block_params + 2 * head_matrix + 4 * shape.num_blocks * seq * attn_dim)
    sliding = sum(n for name, n in shape.named_numels.items() if placements.get(name, "host") != "resident")
    loaded = inputs.grad_accum * sliding / eval_group_size(shape, inputs)
    return ReferencePass(
        compute_s=flops / (inputs.bandwidths.gpu_tflops * 1e12),
        load_bytes=loaded * h2d_bytes_per_param(inputs.master_format),
        loaded_params=loaded,
    )


def eval_group_size(shape: ModelShape, inputs: PlanInputs) -> int:
    """Micro-batches an evaluation (DPO's reference pass too) carries through each unit per load, by the
    engine's rule (:func:`slide_core.engine.evaluation.eval_group_size`). The side inputs (rotary tables,
    masks) are left out here, so this is the engine's group or a little more."""
    from slide_core.engine.evaluation import eval_group_size as engine_rule

    d = inputs.compute_dtype_bytes
    per_batch = inputs.batch_size * inputs.seq_len * shape.activation_width * d
    largest_block = max((shape.named_numels[name] for name in shape.block_names), default=0)
    return engine_rule(per_batch, largest_block * d)


def scheduled_step_s(
    shape: ModelShape,
    inputs: PlanInputs,
    costs: tuple[UnitCost, ...],
    placements: dict[str, str],
    *,
    deferred: bool = False,
) -> float:
    """The step time of the engine's order (slide_hf/planner/step_schedule.py) for ``placements``: each
    unit's compute split from the step's FLOPs as :func:`_times` counts them, its transfers and its update
    priced as :func:`~slide_hf.planner.unit_costs.unit_costs` prices them. ``deferred``: the steady state of
    steps that each clip (Note [Deferred steps] there)."""
    bw = inputs.bandwidths
    d = inputs.compute_dtype_bytes
    seq = inputs.seq_len
    tokens = inputs.batch_size * seq
    rate = bw.gpu_tflops * 1e12
    attention = shape.num_heads * shape.head_dim * seq  # per token per block, times 2 forward, 6 backward
    host_rate = bw.cpu_adam_busy_rate(inputs.optimizer_state, inputs.master_format) * 1e9
    load_bytes = h2d_bytes_per_param(inputs.master_format)
    accumulate_bytes = 8 + d
    by_name = {cost.name: cost for cost in costs}
    work = []
    for name, n in shape.named_numels.items():
        if n == 0:
            continue
        placement = placements[name]
        cost = by_name[name]
        contributions = inputs.grad_accum * (2 if name == shape.names[0] and shape.tied else 1)
        summed = placement == "streamed" and contributions > 1  # Note [Streamed accumulation]
        if name == shape.names[-1]:  # the head
            forward_s, backward_s = _head_flops_per_param(inputs) * n * tokens / rate, 0.0
        elif name == shape.names[0]:  # the embedding
            forward_s = backward_s = 0.0
        else:
            forward_s = 2 * (n + attention) * tokens / rate
            backward_s = 6 * (n + attention) * tokens / rate
        travelling = n * (STREAMED_MASTER_BYTES + state_bytes_per_param(inputs.optimizer_state))  # each way
        gpu_update = (cost.streamed if summed else cost.resident).get("gpu compute", 0.0)
        kept = (4 if summed else d) * n if inputs.clipping else 0  # the gradient kept for a correction
        work.append(
            UnitWork(
                name=name,
                placement=placement,
                numel=n,
                forward_s=forward_s,
                backward_s=backward_s,
                load_bytes=n * load_bytes,
                grad_bytes=n * d * (2 if name == shape.names[0] and shape.tied else 1),
                update_s=n / host_rate if placement == "host" else gpu_update,
                stage_bytes=travelling + (4 * n if summed else 0),  # a summed unit's fp32 sum goes up too
                # with clipping, the gradient kept for a correction goes d2h ahead of the write-back
                writeback_bytes=travelling + kept,
                accumulate_s=n * accumulate_bytes / (bw.host_mem_gbps * 1e9),
                is_block=name in shape.block_names,
                loads_in_backward=name in shape.block_names,
                summed=summed,
            )
        )
    rates = ScheduleRates(
        h2d=bw.h2d_gbps * 1e9,
        d2h=bw.d2h_gbps * 1e9,
        duplex=bw.duplex_gbps * 1e9,
        block_slots=inputs.block_slots,
        staging_sets=inputs.staging_sets,
        micro_batches=inputs.grad_accum,
    )
    return simulate_step(work, rates, deferred=deferred)
