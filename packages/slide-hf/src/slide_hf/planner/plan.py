"""The plan: one :class:`Plan` that puts the byte model and the time model together for a :class:`PlanInputs`.

Also the searches over plans: :func:`largest_batch` (the biggest batch under memory caps) and
:func:`plan_with_placement` (spend the GPU budget's spare memory on device-resident units).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slide_hf.errors import UserError
from slide_hf.planner.auto_tile import at_batch
from slide_hf.planner.inputs import Bandwidths, ModelShape, PlanInputs
from slide_hf.planner.memory import (
    ENGINE_HOST_BUFFERS,
    EngineBuffers,
    _disk_bytes,
    _gpu_bytes,
    _gpu_peak,
    _host_bytes,
    _host_peak,
    engine_buffers,
    resident_scratch_bytes,
)
from slide_hf.planner.timing import _times
from slide_hf.planner.unit_costs import fixed_times, staging_price, unit_costs
from slide_hf.planner.update_placement import streaming_order
from slide_hf.sizes import format_bytes
from slide_hf.spelling import option

__all__ = [
    "GPU_MARGIN_BYTES",
    "UPDATE_PLACEMENTS",
    "Plan",
    "check_update_placement",
    "largest_batch",
    "make_plan",
    "plan_with_placement",
    "replan_streamed",
    "with_streamable",
]

GPU_MARGIN_BYTES = 1 << 30
"""GPU memory left unplanned for allocator fragmentation and library workspaces..."""

GPU_MARGIN_FRACTION = 0.01
"""...plus this share of the budget. Measured peaks on an H200 exceeded the plan by 0.69 GiB at a 12 GiB
budget (3B), 0.95 GiB at 24 GiB (8B) and 1.7 GiB at 128 GiB (14B): a fixed gigabyte alone would have
let a 14B placement on the whole 140 GiB card overrun it."""


@dataclass(frozen=True)
class Plan:
    """Memory and time for one :class:`PlanInputs`. Byte counts are exact integers; times in seconds.

    ``gpu_breakdown`` sums to the GPU peak. ``host_breakdown`` is the host during training; the host
    peak is the larger of its sum and loading (the whole fp32 master on the host before the engine
    moves the resident units' copies to the GPU and gives their pages back). ``max_batch_size`` is the largest batch
    that fits every cap set in the inputs (None when none is set; 0 when not even 1 fits) and
    ``max_batch_limit`` says which cap binds. ``overlap`` is T_bwd / (T_d2h + T_update) for the whole step
    (>= 1: gradient transfer and update hide behind the backward); ``critical_batch_size`` is the
    smallest batch with overlap >= 1.
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
    overlap: float
    binding: str
    critical_batch_size: int | None
    resource_s: dict[str, float] = field(default_factory=dict)
    """Seconds per step of each resource (slide_hf/planner/unit_costs.py ``RESOURCES``). ``compute_s`` is its
    GPU compute, ``pcie_s`` the larger PCIe direction, ``update_s`` the larger of host memory and CPU,
    ``disk_s`` NVMe."""
    reference_step_s: float | None = None
    """``--objective dpo``: seconds of the reference pass over one step's worth of pairs (a forward of each,
    before the first step; the run's pass takes this times its steps' worth of pairs, and the held-out pairs'
    pass of an evaluation this per micro-batch of them too); None otherwise."""
    clipped_step_time_s: float | None = None
    """With clipping (``--max-grad-norm``): the step while clipping fires on every step, each one then
    deferred, its host updates after the backward (Note [Deferred steps] in step_schedule.py); None without.
    ``step_time_s`` is the step while the norm stays under the limit."""
    resource_bound_s: float = 0.0
    """The largest of ``compute_s``, ``pcie_s``, ``update_s`` and ``disk_s``: the step if every resource
    overlapped every other. ``step_time_s`` is the larger of it and the step of the engine's order
    (slide_hf/planner/step_schedule.py), where a unit's load waits for its update and a slot for its gradient."""

    def placement_counts(self) -> dict[str, tuple[str, ...]]:
        """The units updated in each place: ``resident``, ``streamed`` (on the GPU as they stream) and ``host``."""
        i = self.inputs
        names = self.shape.names
        placed = {*i.resident_units, *i.streamed_units}
        return {
            "resident": tuple(n for n in names if n in i.resident_units),
            "streamed": tuple(n for n in names if n in i.streamed_units),
            "host": tuple(n for n in names if n not in placed),
        }

    def buffers(self) -> EngineBuffers:
        """Every buffer the planned run's engine allocates, by name and owner's size (memory.py)."""
        return engine_buffers(self.shape, self.inputs)

    @property
    def engine_host_bytes(self) -> int:
        """Host bytes of the engine's own buffers (everything but the process baseline and NVMe staging)."""
        return sum(self.host_breakdown[key] for key in ENGINE_HOST_BUFFERS)

    def expected_step_s(self, grad_norms: Sequence[float | None], max_grad_norm: float) -> float:
        """The planned step for steps that ran after steps with these gradient norms: a step after one
        that clipped is deferred (``clipped_step_time_s``, Note [Deferred steps] in step_schedule.py), any
        other speculates or runs unclipped (``step_time_s``). The median over the steps, as a run's step
        is the median of its steps; ``step_time_s`` with no norms."""
        if self.clipped_step_time_s is None or max_grad_norm <= 0:
            return self.step_time_s
        planned = [
            self.clipped_step_time_s if _clipped(norm, max_grad_norm) else self.step_time_s for norm in grad_norms
        ]
        return statistics.median(planned) if planned else self.step_time_s

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
                "objective": i.objective,
                "resident_units": list(i.resident_units),
                "streamed_units": list(i.streamed_units),
                "streamable_units": list(i.streamable_units),
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
            "clipped_step_time_s": self.clipped_step_time_s,
            "reference_step_s": self.reference_step_s,
            "resource_bound_s": self.resource_bound_s,
            "tokens_per_s": self.tokens_per_s,
            "overlap": self.overlap,
            "binding": self.binding,
            "critical_batch_size": self.critical_batch_size,
            "resource_s": dict(self.resource_s),
        }


def _clipped(norm: float | None, max_grad_norm: float) -> bool:
    """Whether a step of gradient norm ``norm`` clipped: its coefficient ``max_norm / (norm + 1e-6)`` (as
    ``torch.nn.utils.clip_grad_norm_`` forms it) is below 1."""
    return norm is not None and math.isfinite(norm) and max_grad_norm / (norm + 1e-6) < 1.0


def make_plan(inputs: PlanInputs) -> Plan:
    """Plan memory and time for ``inputs``.

    Time, per optimizer step of T = batch x seq x grad_accum tokens (L blocks, S = seq, d = heads x
    head_dim, V x H the head matrix, N_b the block parameters):

    - compute = T x (8 N_b + 6 V H + 8 L S d) / gpu_tflops. Blocks run forward, recompute forward and
      backward: 2 + 2 + 4 = 8 FLOPs per parameter per token (6 without recompute). The head runs once
      with grad (6 V H). Attention: QK^T and AV are 4 S d per token per layer forward, halved by the
      causal mask, times the same four passes: 8 L S d.
    - pcie = max(h2d, d2h, (h2d + d2h bytes) / duplex rate): each direction at its own rate, and both
      together at the lower rate they reach at once (``Bandwidths.duplex_gbps``). h2d: 4 B/param per load from an fp32
      master, 2 from a split one (``h2d_bytes_per_param``); the embedding and head load once per step; blocks load once in each
      forward and backward, minus the ``block_slots`` still resident where the schedule turns around:
      accum x 2L - (2 accum - 1) x slots. d2h: every unit's gradient in the compute dtype per micro-batch
      (the embedding twice when the head is tied). Both add the activation stash (out and back in).
    - update = max(params / (cpu_adam rate for the state and master formats x ``HOST_ADAM_IN_STEP``),
      (AdamW + accumulation bytes) / host memory bandwidth) (Note [The host optimizer inside a step]).
    - disk = bytes moved to and from NVMe (m and v read and written; stash written and read) / disk_gbps.

    step_time = max(compute, pcie, update, disk). overlap = T_bwd / (T_d2h + T_update), with T_bwd the
    recompute + backward of the blocks plus the head (6 N_b + 6 L S d + 6 V H per token).

    Those are the sums over host-updated units. A device-resident unit moves nothing over PCIe and adds its
    update to the GPU (its bytes over ``gpu_mem_gbps``); a GPU-streamed one sends master and moments both
    ways instead of its gradient, and adds its update to the GPU and its DMA to host memory
    (slide_hf/planner/unit_costs.py). ``Plan.resource_s`` has each resource's time: GPU compute, PCIe h2d,
    d2h and duplex, host memory, CPU, NVMe.
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
        host_peak_bytes=_host_peak(shape, inputs),
        host_breakdown=host,
        disk_bytes=_disk_bytes(shape, inputs),
        max_batch_size=max_batch,
        max_batch_limit=limit,
        **times,
    )


def largest_batch(
    inputs: PlanInputs, *, gpu_cap: int | None, host_cap: int | None, shape: ModelShape | None = None
) -> tuple[int | None, str | None]:
    """``(largest batch size whose peaks fit both caps, the cap that stops it: "gpu" | "host")``.

    ``(None, None)`` with no cap; ``(0, cap)`` when not even batch 1 fits. Each batch is tried with the tile
    its run takes (:func:`~slide_hf.planner.auto_tile.at_batch`): ``--seq-tile auto`` chooses it again for
    each batch, so the answer, planned as ``--batch-size``, fits, and does not depend on the planned batch's
    tile; a tile the user gave stays. Both peaks grow with the batch (auto's at the tile that fits), so a
    doubling search then bisection finds it in a few dozen evaluations of the byte model.
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
        trial = at_batch(inputs, batch)
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
    """:func:`largest_batch` under the inputs' own budgets, of the run before its units are placed
    (:func:`_unplaced`): a run of another batch places its own, so searching with the planned batch's
    placement would stop near the planned batch."""
    return largest_batch(
        _unplaced(inputs), gpu_cap=inputs.gpu_memory_bytes, host_cap=inputs.host_memory_bytes, shape=shape
    )


def _unplaced(inputs: PlanInputs) -> PlanInputs:
    """``inputs`` as every batch's run starts before :func:`plan_with_placement` places its units. Resident
    units, and with ``--update-placement auto`` the streamed ones, take what GPU memory the planned batch
    leaves spare (fewer for a larger batch), and a run is refused on its GPU peak before they are placed
    (slide_hf/setup.py's ``place_units``); placing them only takes memory off the host. A placement that
    streams every unit whose state is in host RAM (``--update-placement gpu``) streams them at any batch,
    those resident at the planned one too: their staging stays."""
    bare = dataclasses.replace(inputs, resident_units=(), streamed_units=(), streamable_units=())
    in_ram = [name for name in bare.shape.names if name not in bare.offloaded_units]
    placed = {*inputs.resident_units, *inputs.streamed_units}
    if inputs.streamed_units and placed.issuperset(in_ram):
        return dataclasses.replace(bare, streamed_units=tuple(in_ram))
    return bare


UPDATE_PLACEMENTS = ("auto", "host", "gpu")
"""Where the updates of units that are not device-resident run (``--update-placement``)."""


def plan_with_placement(inputs: PlanInputs, update_placement: str = "host", *, replaceable: bool = False) -> Plan:
    """The plan after placing units: device-resident ones in the GPU budget's spare memory first, then, by
    ``update_placement``, the units updated on the GPU as they stream (``PlanInputs.streamed_units``):

    - ``host``: none; every unit that is not resident is updated on the host.
    - ``gpu``: every unit that is not resident and keeps its moments in host RAM. Refused in one line on the
      CPU device, or when the staging does not fit the GPU budget. With gradient clipping the streamed units
      speculate on the GPU and the host corrects them in a step that clips (Note [Streamed speculation] in
      slide_core/engine/streamed_pipeline.py).
    - ``auto``: the prefix of :func:`~slide_hf.planner.update_placement.streaming_order` (the units in the
      order their costs, slide_hf/planner/unit_costs.py, favour streaming them) whose plan is fastest within
      the spare GPU memory. None on the CPU device (no PCIe to relieve) or without a GPU budget (nothing to
      fit the staging in).

    Resident units are chosen by :func:`slide_core.engine.placement.choose_resident_units` (embedding, head,
    then the first blocks); without a GPU budget, or for a :class:`ModelShape`, there are none. Their greedy
    takes all the spare memory it can use, so ``auto`` weighs two plans: residents in all of it, then
    streaming in what is left; and residents in the spare memory less what streaming the blocks takes
    (staging sets of the largest), then streaming in that (when it streams any unit). The faster wins (a
    tie keeps the first).
    ``replaceable``: with ``auto``, also the units the run may move to the streamed update between steps
    (:func:`with_streamable`), for a run that re-places from the rates its steps measure.
    """
    check_update_placement(inputs, update_placement)
    if update_placement == "gpu":
        return _all_streamed(inputs)
    plan = make_plan(_with_resident(inputs, reserve_bytes=0))
    if update_placement == "host" or not inputs.accelerator or inputs.gpu_memory_bytes is None:
        return plan
    candidates = [_with_streamed(plan)]
    costs = [c for c in unit_costs(plan.shape, inputs) if c.can_stream and c.name in plan.shape.block_names]
    if costs and not isinstance(inputs.model, ModelShape):
        reserve = staging_price(plan.shape, inputs)(c.name for c in costs)
        reserved = _with_streamed(make_plan(_with_resident(inputs, reserve_bytes=reserve)))
        if reserved.inputs.streamed_units:  # memory held back for streaming that streams nothing is wasted
            candidates.append(reserved)
    best = min(candidates, key=lambda p: p.step_time_s)
    return with_streamable(best) if replaceable else best


def with_streamable(plan: Plan) -> Plan:
    """``plan`` with the units its run may move to the GPU-streamed update between steps, should its steps
    measure other rates than the plan's (``PlanInputs.streamable_units``; slide_hf/replacement.py): units
    that are neither resident nor streamed and could stream (``UnitCost.can_stream``), for as long as the
    GPU memory of streaming them with the streamed ones (``unit_costs.staging_price``: the staging sets of
    the largest, the summed gradients of those that sum) stays within the staging the run holds, the
    smallest first. That staging is the streamed units' (the plan prices it already), or, where the
    blocks need more and the spare GPU memory holds theirs, the blocks': so a run whose plan streams no
    block may still move blocks once its steps show the host optimizer slower than planned. The staging
    is allocated once (Note [Re-placement at a step boundary] in slide_core/engine/replacement.py) and
    priced here, so the placed plan still fits the budget; its step time is unchanged (the units start on
    the host)."""
    inputs = plan.inputs
    if inputs.gpu_memory_bytes is None or not inputs.accelerator:
        return plan
    held = set(inputs.resident_units) | set(inputs.streamed_units)
    price = staging_price(plan.shape, inputs)
    costs = [c for c in unit_costs(plan.shape, inputs) if c.can_stream and c.name not in held]
    streamed = list(inputs.streamed_units)
    staged = price(streamed)
    blocks = price([*streamed, *(c.name for c in costs if c.name in plan.shape.block_names)])
    if staged < blocks <= staged + _spare_bytes(plan):
        staged = blocks
    chosen: list[str] = []
    for cost in sorted(costs, key=lambda c: c.stream_device_bytes):  # stable: forward order among equals
        if price([*streamed, *chosen, cost.name]) <= staged:
            chosen.append(cost.name)
    if not chosen:
        return plan
    names = tuple(c.name for c in costs if c.name in chosen)
    return make_plan(dataclasses.replace(inputs, streamable_units=names))


def replan_streamed(plan: Plan, bandwidths: Bandwidths) -> Plan:
    """The streamed units the run of ``plan`` should update on the GPU, chosen as ``auto`` chooses them
    (the fastest prefix of :func:`~slide_hf.planner.update_placement.streaming_order`) but with
    ``bandwidths`` (the rates its own steps measured, slide_hf/replacement.py) and among what the run can
    move without allocating: its streamed and streamable units, within the staging it holds. The resident
    units stay. Returns the plan of that placement, whose ``streamed_units`` may be those of ``plan``."""
    inputs = plan.inputs
    movable = (*inputs.streamed_units, *inputs.streamable_units)
    start = dataclasses.replace(inputs, bandwidths=bandwidths, streamed_units=(), streamable_units=movable)
    base = make_plan(start)
    held = plan.gpu_breakdown.get("streamed_staging", 0)
    return _with_streamed(base, candidates=set(movable), budget_bytes=held)


def _spare_bytes(plan: Plan) -> int:
    """GPU bytes the budget leaves beside ``plan``'s peak and the margin (0 without a budget)."""
    budget = plan.inputs.gpu_memory_bytes
    if budget is None:
        return 0
    return max(0, budget - plan.gpu_peak_bytes - GPU_MARGIN_BYTES - int(GPU_MARGIN_FRACTION * budget))


def _with_resident(inputs: PlanInputs, *, reserve_bytes: int) -> PlanInputs:
    """``inputs`` with the resident units the spare GPU memory less ``reserve_bytes`` holds."""
    import torch

    from slide_core.engine.placement import choose_resident_units

    if inputs.gpu_memory_bytes is None or isinstance(inputs.model, ModelShape):
        return inputs
    base = make_plan(inputs)
    # Resident units bring their update's scratch (at most that of the largest unit's ranges) along.
    scratch = resident_scratch_bytes(inputs, max(base.shape.unit_numels, default=0))
    spare = max(0, _spare_bytes(base) - scratch - reserve_bytes)
    dtype = torch.float32 if inputs.compute_dtype_bytes == 4 else torch.bfloat16
    accumulates = inputs.grad_accum > 1  # clipping sums a tied embedding in its slot too (resident.py)
    arrays = inputs.device_optimizer().state_arrays
    resident = choose_resident_units(inputs.model, spare, dtype, accumulates=accumulates, state_arrays=arrays)
    return dataclasses.replace(inputs, resident_units=resident)


def _with_streamed(plan: Plan, *, candidates: set[str] | None = None, budget_bytes: int | None = None) -> Plan:
    """``plan`` with the units streamed that make its step fastest within its spare memory: the prefix of
    :func:`~slide_hf.planner.update_placement.streaming_order` whose plan has the smallest step time (the
    engine's order, slide_hf/planner/step_schedule.py), each longer prefix only where it gains ``_GAIN``.
    ``candidates`` and ``budget_bytes``: only those units may stream, their staging within that many bytes
    (a running engine's, :func:`replan_streamed`); by default every unit that is not resident, within the
    spare memory."""
    inputs = plan.inputs
    resident = set(inputs.resident_units)
    costs = unit_costs(plan.shape, inputs)
    fixed = fixed_times(plan.shape, inputs, plan.flops_per_step / (inputs.bandwidths.gpu_tflops * 1e12), plan.disk_s)
    for cost in costs:  # resident units are placed already: their terms are fixed
        if cost.name in resident:
            for resource, seconds in cost.resident.items():
                fixed[resource] += seconds
    movable = [cost for cost in costs if cost.name not in resident]
    if candidates is not None:  # the others are placed already: their host terms are fixed
        for cost in movable:
            if cost.name not in candidates:
                for resource, seconds in cost.host.items():
                    fixed[resource] += seconds
        movable = [cost for cost in movable if cost.name in candidates]
    budget = _spare_bytes(plan) if budget_bytes is None else budget_bytes
    order = [name for name, _ in streaming_order(fixed, movable, budget, staging_price(plan.shape, inputs))]
    best = plan
    for count in range(1, len(order) + 1):
        streamed = set(order[:count])
        names = tuple(cost.name for cost in movable if cost.name in streamed)
        trial = make_plan(dataclasses.replace(inputs, streamed_units=names))
        if trial.step_time_s < best.step_time_s * (1 - _GAIN):
            best = trial
    return best


_RESERVE_ROUNDS = 4
"""Placements of the residents :func:`_all_streamed_with` tries, each reserving the previous one's overshoot
of the GPU budget besides the staging; one or two settle it (a resident unit is the step of the search)."""

_GAIN = 0.01
"""Streaming more units must shorten the planned step by more than this fraction: the plan is a planning
number (within 10 % of measured steps), and a streamed unit costs GPU memory and PCIe both ways for it."""


def check_update_placement(inputs: PlanInputs, update_placement: str) -> None:
    """Refuse, in one line, an ``--update-placement`` that cannot run for ``inputs``: an unknown one, and
    gpu on the CPU device. `slide train` meets it in :func:`plan_with_placement`; `slide plan`
    calls it before planning a placement, wherever it plans one, so both refuse in the same words."""
    if update_placement not in UPDATE_PLACEMENTS:
        raise UserError(
            f"{option('update_placement')} must be one of {', '.join(UPDATE_PLACEMENTS)}, got {update_placement!r}"
        )
    if update_placement == "gpu":
        _refuse_gpu_updates(inputs)


def _refuse_gpu_updates(inputs: PlanInputs) -> None:
    if not inputs.accelerator:
        raise UserError(f"{option('update_placement', 'gpu')} needs a GPU device; the CPU device updates on the host")


def _all_streamed(inputs: PlanInputs) -> Plan:
    """Residents in the spare memory less the staging of streaming every unit whose moments are in host RAM
    (sets of the largest), every other such unit streamed; with two staging sets where three do not fit
    the GPU budget (a large vocabulary's embedding streamed sizes every set); one line when two do not fit
    either."""
    budget = inputs.gpu_memory_bytes
    if inputs.staging_sets > 2 and budget is not None:
        plan = _all_streamed_with(inputs)
        if plan.gpu_peak_bytes <= budget:
            return plan
        inputs = dataclasses.replace(inputs, staging_sets=2)
    return _all_streamed_with(inputs, refuse=True)


def _all_streamed_with(inputs: PlanInputs, *, refuse: bool = False) -> Plan:
    """:func:`_all_streamed` with ``inputs.staging_sets`` sets; ``refuse``: one line when it does not fit."""
    shape = inputs.shape
    on_nvme = set(inputs.offloaded_units)
    streamable = [c for c in unit_costs(shape, inputs) if c.name not in on_nvme]
    reserve = staging_price(shape, inputs)(c.name for c in streamable)
    budget = inputs.gpu_memory_bytes
    for _ in range(_RESERVE_ROUNDS):
        placed = _with_resident(inputs, reserve_bytes=reserve)
        names = tuple(c.name for c in streamable if c.name not in placed.resident_units)
        plan = make_plan(dataclasses.replace(placed, streamed_units=names))
        over = plan.gpu_peak_bytes - budget if budget is not None else 0
        if over <= 0 or not placed.resident_units:
            break
        # The residents took room the streamed units' peak needs (their staging beside the backward's
        # largest phase, which the reserve alone does not see): fewer residents, by the overshoot.
        reserve += over
    if refuse and budget is not None and plan.gpu_peak_bytes > budget:
        staging = plan.gpu_breakdown.get("streamed_staging", 0)
        raise UserError(
            f"{option('update_placement', 'gpu')} needs {format_bytes(plan.gpu_peak_bytes)} of GPU memory "
            f"({format_bytes(staging)} of it to stage the streamed units), {format_bytes(budget)} in the budget; "
            f"use {option('update_placement', 'auto')} or host"
        )
    return plan
