"""Bytes and loads per parameter: what one step moves over PCIe and through host memory, by master and
state format. A leaf of the planner: the unit costs (unit_costs.py), the step time (timing.py) and the
data-parallel plan (distributed.py) all read it, and it reads only the inputs."""

from __future__ import annotations

from slide_core.optim.state_formats import state_bytes_per_param
from slide_hf.planner.inputs import HOST_ADAM_BUSY_SHARE, ModelShape, PlanInputs

__all__ = [
    "HOST_ADAM_BUSY_SHARE",
    "adam_bytes_per_param",
    "block_loads",
    "h2d_bytes_per_param",
    "host_bytes_per_param_step",
]

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
    (``adam_bytes_per_param`` plus the gradient read; the master's 8 are the same in both formats, read
    and written once) and the DMA (``loads`` h2d reads of the master, one d2h write of the gradient)."""
    optimizer = adam_bytes_per_param(optimizer_state) + compute_bytes
    dma = loads * h2d_bytes_per_param(master_format) + compute_bytes
    return {"optimizer": optimizer, "dma": dma, "total": optimizer + dma}


_ADAM_BYTES_PER_PARAM = 24
"""Host memory traffic of one fp32 AdamW update per parameter besides the gradient read: read and write
master, m and v in one fused pass (slide_core/optim/fused_adamw.py, what `slide train` runs where numba is
installed). TorchAdamW, the fallback without numba, also casts the gradient into an fp32 scratch and reads
it back (8 B more); the plan prices the fused kernel, whose 26 B/param (gradient included) measured on an
H200 (16 cores, 128 GiB) match its rate: a planned 34 made the host memory term bind at 2.21 s where the
optimizer took 1.87 s (Note [The host optimizer inside a step])."""


def adam_bytes_per_param(optimizer_state: str) -> float:
    """Host bytes one AdamW update moves per parameter besides reading the gradient, in the fused kernel
    (no scratch): master 8 + m and v read and written in their format (fp32: ``_ADAM_BYTES_PER_PARAM``,
    bf16: 8, int8: ~4.1)."""
    if optimizer_state == "fp32":
        return _ADAM_BYTES_PER_PARAM
    return 8 + 2 * state_bytes_per_param(optimizer_state)


def block_loads(shape: ModelShape, inputs: PlanInputs) -> int:
    """Block weight loads per step: every block in both passes of every micro-batch, less the
    ``block_slots`` still in a slot where the schedule turns around."""
    blocks = shape.num_blocks
    if not blocks:
        return 0
    resident = min(inputs.block_slots, blocks)
    return inputs.grad_accum * 2 * blocks - (2 * inputs.grad_accum - 1) * resident
