"""Does a plan fit this machine? The host RAM available, the budget check, and the one-line fix to try.

The hints re-plan with cheaper settings (NVMe offload, a smaller batch) until one fits, so this module
sits on top of the plan and memory models; it is what ``slide plan --check`` and ``slide train`` call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import psutil

from slide_hf.errors import UserError
from slide_hf.planner.inputs import ModelShape, PlanInputs
from slide_hf.planner.memory import _host_peak
from slide_hf.planner.plan import Plan, largest_batch
from slide_hf.planner.sizes import format_bytes

__all__ = ["available_host_bytes", "check_fits"]


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
