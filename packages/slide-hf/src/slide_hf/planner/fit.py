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
from slide_hf.sizes import format_bytes
from slide_hf.spelling import option

__all__ = ["available_host_bytes", "check_fits"]


HOST_HEADROOM_FRACTION = 0.12
"""Share of the machine's RAM a plan must leave free. A run's pinned slabs cannot be reclaimed, so the
kernel, the page cache and the data loader need room beside them: on a 128 GiB H200 machine a 14B run
planned at 111.5 GiB of host memory (plans there are within 2% of the measured peak) was killed with
124.5 GiB available, while runs at 93-94 GiB were not."""


def device_gpu_budget(device: Any) -> int | None:
    """The GPU bytes a run on ``device`` plans within: its ``--gpu-memory`` cap, else the whole card;
    None on the CPU. `slide train` and `slide bench` place units within the same budget this way."""
    if not device.is_accelerator:
        return None
    return device.memory_limit_bytes or device.facts().total_memory_bytes


def available_host_bytes() -> int:
    """Host RAM a new training process can take: the kernel's ``MemAvailable`` less the headroom above.

    Not ``available + this process's RSS``: the run being planned is a separate (``slide train``)
    process, and the planning process itself is small.
    """
    memory = psutil.virtual_memory()
    return max(0, int(memory.available - HOST_HEADROOM_FRACTION * memory.total))


def check_fits(
    plan: Plan,
    *,
    host_available: int | None,
    gpu_available: int | None,
    gpu_source: str = "allowed by --gpu-memory",
    host_source: str = "available",
) -> None:
    """Raise :class:`UserError` (one line, with the fix to try) when ``plan`` exceeds a budget.

    A None budget is not checked. ``gpu_source`` and ``host_source`` say where each budget came from.
    """
    problems = []
    inputs, shape = plan.inputs, plan.shape
    if gpu_available is not None and plan.gpu_peak_bytes > gpu_available:
        best, _ = largest_batch(inputs, gpu_cap=gpu_available, host_cap=None, shape=shape)
        if best:
            hint = f"try a smaller {option('batch_size')} (largest that fits: {best})"
        elif inputs.block_slots > 1:
            hint = f"not even {option('batch_size')} 1 fits; try {option('block_slots')} 1 or a shorter {option('seq_len')}"
        else:
            hint = f"not even {option('batch_size')} 1 fits; try a shorter {option('seq_len')} or a larger GPU"
        hint += _masks_hint(inputs)
        problems.append(
            f"needs {format_bytes(plan.gpu_peak_bytes)} GPU memory, {format_bytes(gpu_available)} {gpu_source}; {hint}"
        )
    if host_available is not None and plan.host_peak_bytes > host_available:
        hint = _host_hint(inputs, shape, host_available)
        compact = _compact_state_that_fits(inputs, shape, host_available)
        if compact is not None:  # beside an exact fix, or as the one left when none fits
            joint = "; or, in RAM," if hint.startswith("try ") else ", or try"
            hint += (
                f"{joint} {option('optimizer_state')} {compact} (rounded moments, not exact: docs/optimizer_state.md)"
            )
        problems.append(
            f"needs {format_bytes(plan.host_peak_bytes)} host RAM, {format_bytes(host_available)} {host_source}; {hint}"
        )
    if problems:
        raise UserError("; also ".join(problems))


def _masks_hint(inputs: PlanInputs) -> str:
    """Where (S x S) attention masks are part of the GPU peak: how much, and what removes them
    (slide_hf/planner/attention_masks.py)."""
    from slide_hf.planner.attention_masks import attention_masks

    masks = attention_masks(inputs)
    if not masks.any:
        return ""
    kinds = ", ".join(sorted({layer_type for layer_type, _ in masks.layers}))
    size = format_bytes(masks.held_bytes + masks.call_bytes)
    return f"; {size} of it are (S x S) attention masks of {kinds} layers with sdpa: {masks.remedy()}"


def _host_hint(inputs: PlanInputs, shape: ModelShape, available: int) -> str:
    """The first change (cumulative, cheapest first) that makes the host side fit."""
    steps: list[tuple[str, dict[str, Any]]] = []
    fraction = _smallest_nvme_fraction(inputs, shape, available)
    if inputs.offload_optimizer == "ram":
        if fraction is not None and fraction < 1.0:
            return f"try {option('offload_optimizer')} nvme {option('nvme_fraction')} {fraction:g}"
        steps.append((f"{option('offload_optimizer')} nvme", {"offload_optimizer": "nvme", "nvme_fraction": 1.0}))
    elif inputs.nvme_fraction < 1.0:
        if fraction is not None and fraction < 1.0:
            return f"try {option('nvme_fraction')} {fraction:g}"
        steps.append((f"{option('nvme_fraction')} 1", {"nvme_fraction": 1.0}))
    if inputs.offload_activations == "ram":
        steps.append((f"{option('offload_activations')} nvme", {"offload_activations": "nvme"}))
    flags: list[str] = []
    changes: dict[str, Any] = {}
    for flag, change in steps:
        flags.append(flag)
        changes.update(change)
        if _host_peak(shape, _trial(inputs, **changes)) <= available:
            return "try " + " ".join(flags)
    trial = _trial(inputs, **changes)
    best, _ = largest_batch(trial, gpu_cap=None, host_cap=available, shape=shape)
    if best and best < inputs.batch_size:
        return "try " + " ".join([*flags, f"{option('batch_size')} {best}"])
    floor = _host_peak(shape, dataclasses.replace(trial, batch_size=1))
    with_flags = f" even with {' '.join(flags)}" if flags else ""
    return f"the model alone needs {format_bytes(floor)}{with_flags}; use a machine with more RAM"


COMPACT_STATES = ("bf16", "int8")
"""The opt-in Adam state formats, in the order of the bytes they save (docs/optimizer_state.md)."""


def _compact_state_that_fits(inputs: PlanInputs, shape: ModelShape, available: int) -> str | None:
    """The first state format more compact than the run's with which the host side fits as it is (no more
    on NVMe), or None. Offered beside the exact fixes, never instead of them: it changes the math. Each
    format is priced with the shipped optimizer that keeps it (``optimizer=None``): the run's own
    optimizer, which the plan may hold, keeps the run's format."""
    formats: tuple[str, ...] = COMPACT_STATES
    if inputs.optimizer_state in formats:
        formats = formats[formats.index(inputs.optimizer_state) + 1 :]
    for state in formats:
        if _host_peak(shape, dataclasses.replace(inputs, optimizer_state=state, optimizer=None)) <= available:
            return state
    return None


def _trial(inputs: PlanInputs, **changes: Any) -> PlanInputs:
    """``inputs`` with a hint's ``changes``, as the run they suggest would place it: a unit whose Adam state
    the change moves to NVMe is no longer one the run may move to the GPU-streamed update (a streamed unit
    keeps its state in RAM; ``UnitCost.can_stream``)."""
    trial = dataclasses.replace(inputs, **changes)
    on_tier = set(trial.offloaded_units)
    if on_tier & set(trial.streamable_units):
        trial = dataclasses.replace(
            trial, streamable_units=tuple(n for n in trial.streamable_units if n not in on_tier)
        )
    return trial


def _smallest_nvme_fraction(inputs: PlanInputs, shape: ModelShape, available: int) -> float | None:
    """The smallest ``--nvme-fraction`` (in steps of 0.05) whose host peak fits, or None: each unit's
    Adam state moved to NVMe costs disk time every step, so the hint moves no more than needed."""
    for twentieths in range(1, 21):
        fraction = twentieths / 20
        if inputs.offload_optimizer == "nvme" and fraction <= inputs.nvme_fraction:
            continue
        if _host_peak(shape, _trial(inputs, offload_optimizer="nvme", nvme_fraction=fraction)) <= available:
            return fraction
    return None
