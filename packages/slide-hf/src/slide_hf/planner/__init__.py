"""Memory and step-time planning: what a SlideFormer run needs before any byte is allocated.

Bytes are modelled in ``memory.py`` (host buffers exactly as the engine allocates them, the GPU peak as
persistent slots plus the largest per-phase transient); times in ``timing.py``.

Step time assumes perfect overlap of the pipelines the engine runs concurrently (GPU compute, PCIe in
each direction, the CPU optimizer, NVMe when used) and takes the slowest; see :func:`make_plan` for each
formula. It is a planning number (within tens of percent), not a benchmark.

The package, one job per module (each imports only the ones above it):

- :mod:`~slide_hf.sizes`: ``24GiB`` in, ``30.1 GiB`` out;
- :mod:`~slide_hf.planner.activations`: the bytes a block saves for autograd, measured on the meta device;
- :mod:`~slide_hf.planner.inputs`: :class:`Bandwidths`, :class:`ModelShape`, :class:`PlanInputs`;
- :mod:`~slide_hf.planner.seq_tiles`: what tiling the blocks' MLPs and norms over tokens changes (``--seq-tile``);
- :mod:`~slide_hf.planner.memory`: host, GPU and disk bytes;
- :mod:`~slide_hf.planner.timing`: step time, overlap and the critical batch;
- :mod:`~slide_hf.planner.plan`: :class:`Plan`, :func:`make_plan`, :func:`largest_batch`,
  :func:`plan_with_placement`;
- :mod:`~slide_hf.planner.fit`: :func:`check_fits` against the machine's budgets;
- :mod:`~slide_hf.planner.seq_fit`: the longest ``--seq-len`` the GPU and host budgets hold.
- :mod:`~slide_hf.planner.auto_tile`: the tile ``--seq-tile auto`` takes.

Import from ``slide_hf.planner``; the submodules are an implementation detail.
"""

from __future__ import annotations

from slide_hf.planner.fit import available_host_bytes, check_fits, device_gpu_budget
from slide_hf.planner.inputs import Bandwidths, ModelShape, Offload, PlanInputs
from slide_hf.planner.memory import CUDA_CONTEXT_BYTES, ENGINE_HOST_BUFFERS, PROCESS_BASELINE_BYTES, GiB
from slide_hf.planner.plan import GPU_MARGIN_BYTES, Plan, largest_batch, make_plan, plan_with_placement
from slide_hf.sizes import format_bytes, parse_size

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "ENGINE_HOST_BUFFERS",
    "GPU_MARGIN_BYTES",
    "PROCESS_BASELINE_BYTES",
    "Bandwidths",
    "GiB",
    "ModelShape",
    "Offload",
    "Plan",
    "PlanInputs",
    "available_host_bytes",
    "check_fits",
    "device_gpu_budget",
    "format_bytes",
    "largest_batch",
    "make_plan",
    "parse_size",
    "plan_with_placement",
]
