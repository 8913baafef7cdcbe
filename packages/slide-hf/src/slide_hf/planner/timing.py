"""Seconds: the step time of a :class:`PlanInputs`, its binding pipeline, overlap and the critical batch.

Step time assumes perfect overlap of the pipelines the engine runs concurrently (GPU compute, PCIe in
each direction, the CPU optimizer, NVMe when used) and takes the slowest; see
:func:`slide_hf.planner.make_plan` for each formula. It is a planning number (within tens of percent),
not a benchmark.
"""

from __future__ import annotations

import math
from typing import Any

from slide_core.optim.state_formats import state_bytes_per_param
from slide_hf.planner.inputs import ModelShape, PlanInputs
from slide_hf.planner.memory import _nvme_units

__all__: list[str] = []

_H2D_BYTES_PER_PARAM = 4
"""Bytes per parameter per load from an fp32 master: the engine copies straight from the fp32 slab into
the compute-dtype slot (``HostPipeline.load``); a non-blocking cross-dtype host-to-device copy moves the
source's fp32 bytes and casts on the device. A split master sends its bf16 plane instead: 2 bytes."""


def h2d_bytes_per_param(master_format: str) -> int:
    """Bytes per parameter per load: 4 from an fp32 master, 2 from a split one (slide_core/split_master.py)."""
    return 2 if master_format == "split" else _H2D_BYTES_PER_PARAM


def host_bytes_per_param_step(
    master_format: str, optimizer_state: str, compute_bytes: int, loads: float = 2.0
) -> dict[str, float]:
    """Host memory bytes per host-updated parameter per step (one micro-batch): the optimizer's update
    (``_adam_bytes_per_param`` plus the gradient read; the master's 8 are the same in both formats, read
    and written once) and the DMA (``loads`` h2d reads of the master, one d2h write of the gradient)."""
    optimizer = _adam_bytes_per_param(optimizer_state) + compute_bytes
    dma = loads * h2d_bytes_per_param(master_format) + compute_bytes
    return {"optimizer": optimizer, "dma": dma, "total": optimizer + dma}


_ADAM_BYTES_PER_PARAM = 32
"""Host memory traffic of one fp32 AdamW update per parameter: read and write master, m and v (24 B),
and the gradient cast into the fp32 scratch and read back (8 B)."""


_STATE_SPEED = {"fp32": 1.0, "bf16": 1.15, "int8": 0.73}
"""Host AdamW updates per second with a compact state, relative to fp32 state: bench/cpu_adam.py on the
H200 machine's host (16 threads, 100M parameters): fp32 4.25, bf16 4.88, int8 3.09 Gparam/s. bf16 moves 18
bytes instead of 26 but hashes and rounds every element; int8 (two passes per 64-element block) is bound
by its arithmetic there (44 GB/s effective against the triad's 77), so it saves memory, not time."""


def _adam_bytes_per_param(optimizer_state: str) -> float:
    """Host bytes one AdamW update moves per parameter besides reading the gradient: fp32 state as
    ``_ADAM_BYTES_PER_PARAM``; compact state in the fused kernel, which reads the gradient as it is (no
    scratch): master 8 + m and v read and written in their format (bf16: 8, int8: ~4.1)."""
    if optimizer_state == "fp32":
        return _ADAM_BYTES_PER_PARAM
    return 8 + 2 * state_bytes_per_param(optimizer_state)


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

    stash = layers * inputs.batch_size * seq * shape.activation_width * d  # per micro-batch
    stash_pcie = stash * accum
    mean_block = sum(shape.block_numels) / layers if layers else 0.0
    loads = shape.embedding_numel + shape.head_numel + _block_loads(shape, inputs) * mean_block
    h2d_bytes = h2d_bytes_per_param(inputs.master_format) * loads + stash_pcie
    grad_numel = shape.total_numel + (shape.embedding_numel if shape.tied else 0)
    d2h_grad_bytes = accum * grad_numel * d
    d2h_s = d2h_grad_bytes / (bw.d2h_gbps * 1e9)
    pcie_s = max(h2d_bytes / (bw.h2d_gbps * 1e9), (d2h_grad_bytes + stash_pcie) / (bw.d2h_gbps * 1e9))

    contributions = accum * grad_numel  # gradient chunks the optimizer thread receives, in elements
    accum_traffic = (contributions - shape.total_numel) * (8 + d) if contributions > shape.total_numel else 0
    adam_bytes = _adam_bytes_per_param(inputs.optimizer_state)
    host_traffic = shape.total_numel * (adam_bytes + d) + accum_traffic
    adam_rate = bw.cpu_adam_gparams * 1e9 * _STATE_SPEED[inputs.optimizer_state]
    update_s = max(shape.total_numel / adam_rate, host_traffic / (bw.host_mem_gbps * 1e9))

    disk_traffic = 2 * state_bytes_per_param(inputs.optimizer_state) * sum(_nvme_units(shape, inputs))
    if inputs.offload_activations == "nvme":
        disk_traffic += 2 * stash * accum
    disk_s = disk_traffic / (bw.disk_gbps * 1e9)

    limits = {"gpu compute": compute_s, "pcie": pcie_s, "host memory bandwidth": update_s, "nvme": disk_s}
    binding = max(limits, key=limits.__getitem__)
    hide = d2h_s + update_s
    overlap = backward_s / hide if hide > 0 else math.inf
    per_sample_bwd = backward_s / inputs.batch_size
    critical = math.ceil(hide / per_sample_bwd - 1e-9) if per_sample_bwd > 0 else None
    return {
        "flops_per_step": flops,
        "compute_s": compute_s,
        "pcie_s": pcie_s,
        "update_s": update_s,
        "disk_s": disk_s,
        "step_time_s": max(limits.values()),
        "overlap": overlap,
        "binding": binding,
        "critical_batch_size": max(1, critical) if critical is not None else None,
    }
