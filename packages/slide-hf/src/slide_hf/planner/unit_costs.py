"""Seconds per step that each unit adds to each resource, for each place its update can run.

A step's resources run concurrently (GPU compute, PCIe in each direction and both together, host memory, the
host CPU's optimizer, NVMe), so the step takes as long as the busiest one (slide_hf/planner/timing.py). Each resource's
time is a fixed part (the GPU's forward and backward, the activation stash crossing PCIe, NVMe traffic) plus
one term per unit that depends on where the unit is updated:

- ``host``: the weights load h2d from the host master (``loads`` per step); the gradient goes d2h once per
  contribution (micro-batch; the tied embedding twice); the host optimizer reads and writes master and
  moments and sums the contributions (host memory) at its measured rate (CPU).
- ``streamed``: the weights load for the forward as for ``host``; the fp32 master (4 B/param, split or not)
  and the moments as stored travel h2d for the unit's backward, which reads its weights from that master
  instead of loading them again (Note [The backward reads the staged master]), and back d2h after its update, which runs on the GPU (its
  memory bandwidth); on the host only the DMA touches them (read once, written once); without clipping the
  gradient never leaves the GPU and the CPU does nothing (slide_core/engine/streamed_pipeline.py). With
  clipping the gradient also goes d2h once into the clipping store, kept for a correction (Note [Streamed
  speculation] there): compute-dtype bytes per parameter on the d2h link and into host memory. The plan
  prices a step that speculates; a step that clips adds a host correction pass, and the step after it
  updates the streamed units on the host (Note [Deferred clipped steps]). A unit with several
  gradient contributions per step (gradient accumulation, a tied embedding) sends those before its last
  d2h to be summed on the host as a host unit's are, the fp32 sum travels h2d with the master (4 B/param)
  and the last contribution is added to it on the GPU (Note [Streamed accumulation] there); every load of
  such a unit reads the host master, and with clipping the fp32 sum (not the compute-dtype gradient) goes
  back d2h for a correction. The staging then lends such a unit an fp32 sum while it is staged
  (:func:`staging_price`).
- ``resident``: only the GPU update.

:func:`unit_costs` gives those terms and :func:`fixed_times` the fixed part; :func:`resource_times` sums them
for a placement. The host terms sum to the formulas :func:`slide_hf.planner.make_plan` documents.
:func:`staging_price` gives the GPU bytes of streaming a set of units, which are no sum of per-unit terms
(the staging sets are sized by the largest unit, the summed gradients' pool by how many units sum).

PCIe has three resources: each direction alone at its measured rate, and ``pcie duplex``, the bytes of both
directions at the rate they reach together (``Bandwidths.duplex_gbps``), which is less than the sum of the
two: a step moving much both ways (GPU-streamed units) is bound by the duplex term, one moving mostly h2d
(host-updated units) by the h2d term.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from slide_core.optim.state_formats import state_bytes_per_param
from slide_hf.planner.inputs import HOST_ADAM_BUSY_SHARE, ModelShape, PlanInputs
from slide_hf.planner.traffic import adam_bytes_per_param, block_loads, h2d_bytes_per_param

__all__ = ["RESOURCES", "StagingPrice", "UnitCost", "fixed_times", "resource_times", "staging_price", "unit_costs"]

RESOURCES = ("gpu compute", "pcie h2d", "pcie d2h", "pcie duplex", "host memory", "cpu", "nvme")
"""The resources a step's time is the largest of, in the order plans print them."""

STREAMED_MASTER_BYTES = 4
"""Bytes per parameter of the master a streamed unit sends each way: fp32, or a split master's two planes."""

HOST_ADAM_IN_STEP = 0.62
"""The host AdamW's rate inside a training step, relative to ``slide doctor``'s measurement of it alone.

Note [The host optimizer inside a step]: in a step the host optimizer shares memory bandwidth with the DMA
(weight loads read the master, gradients land) and its cores with the engine's copy and bookkeeping threads,
and it idles at the step's start until the first gradient arrives; the doctor times it alone on a warm range.
Measured on an H200 (16 cores, 128 GiB), llama3.1-8b, batch 16 x 1024, --gpu-memory 24, host placement, the
doctor's rates 5.81 (fp32 state) and 5.76 (bf16 state) Gparam/s with an fp32 master:

- fp32 master, fp32 state, 7.29e9 host-updated params: the optimizer busy 1.87 s (3.9 Gparam/s, 0.67 of the
  doctor's), the step 2.15 s (0.58);
- split master, bf16 state, 6.76e9 params: busy 2.02 s (3.35 Gparam/s; 0.66 of 5.76 x ``SPLIT_MASTER_SPEED``
  = 5.04), the step 2.28 s (0.59).

The plan's step is its busiest resource and has no term for the optimizer's idle start, so the factor sits
between the two: 0.62 puts both runs' host optimizer within 10% of its busy time and of the step (fp32
2.02 s, split 2.16 s). The host memory term binds in neither (fp32: 26 B/param over the 112 GB/s triad,
1.69 s; the fused kernel alone moved 151 GB/s): it bounds machines whose memory is slow for their cores."""


@dataclass(frozen=True)
class UnitCost:
    """What one unit adds to each resource (seconds per step) when updated on the host, GPU-streamed or
    resident, and the GPU memory streaming it needs.

    ``stream_device_bytes``: GPU bytes the streamed updates hold to stream this unit alone
    (:func:`staging_price` of it): ``PlanInputs.staging_sets`` staging sets of its size (Note [Three staging
    sets] in update_staging.py), its fp32 summed gradient when it gets several contributions a step, with
    clipping the fp32 ``c_u * g`` of one transfer chunk, and the device optimizer's scratch for its ranges;
    the bytes of several streamed units are :func:`staging_price` of them all. ``can_stream``: False for a
    unit whose moments live on NVMe (the engine streams only units whose state is in host RAM)."""

    name: str
    numel: int
    host: Mapping[str, float]
    streamed: Mapping[str, float]
    resident: Mapping[str, float]
    stream_device_bytes: int
    can_stream: bool = True

    def times(self, placement: str) -> Mapping[str, float]:
        return {"host": self.host, "streamed": self.streamed, "resident": self.resident}[placement]


def _named_loads(shape: ModelShape, inputs: PlanInputs) -> dict[str, float]:
    """Weight loads per step of each unit: the embedding and head once; a block the mean of the blocks'
    loads (``traffic.block_loads`` over the blocks)."""

    blocks = shape.num_blocks
    names = shape.names
    loads = {names[0]: 1.0}
    loads.update({name: block_loads(shape, inputs) / blocks for name in names[1:-1]})
    loads[names[-1]] = 1.0
    return loads


def unit_costs(shape: ModelShape, inputs: PlanInputs) -> tuple[UnitCost, ...]:
    """Every unit's terms, in forward order (embedding, blocks, head)."""
    bw = inputs.bandwidths
    d = inputs.compute_dtype_bytes
    load_bytes = h2d_bytes_per_param(inputs.master_format)
    state_bytes = state_bytes_per_param(inputs.optimizer_state)
    adam_bytes = adam_bytes_per_param(inputs.optimizer_state)
    # The step's average rate: the busy one (measured in this machine's steps, or the share of the stand-alone
    # one) with the idle time folded in, as HOST_ADAM_IN_STEP is to HOST_ADAM_BUSY_SHARE.
    busy = bw.cpu_adam_busy_rate(inputs.optimizer_state, inputs.master_format)
    adam_rate = busy * (HOST_ADAM_IN_STEP / HOST_ADAM_BUSY_SHARE) * 1e9
    h2d, d2h, duplex, host_mem, gpu_mem = (
        x * 1e9 for x in (bw.h2d_gbps, bw.d2h_gbps, bw.duplex_gbps, bw.host_mem_gbps, bw.gpu_mem_gbps)
    )
    on_nvme = set(inputs.offloaded_units)
    loads = _named_loads(shape, inputs)
    staging = staging_price(shape, inputs)
    costs = []
    for name, n in shape.named_numels.items():
        contributions = inputs.grad_accum * (2 if name == shape.names[0] and shape.tied else 1)
        summed = contributions > 1  # Note [Streamed accumulation]: the earlier ones summed on the host
        earlier = (contributions - 1) * n * d  # streamed: the contributions before the last, d2h
        sum_up = 4 * n if summed else 0  # streamed: their fp32 sum, h2d with the master
        travelling = n * (STREAMED_MASTER_BYTES + state_bytes)  # master and moments, one way
        kept = n * (4 if summed else d) if inputs.clipping else 0  # the gradient kept for a correction (d2h)
        # The GPU update reads the final gradient, master and moments, writes them and the compute copy;
        # a summed one first adds the last contribution to the staged sum.
        gpu_update = n * (d + 8 + 2 * state_bytes + d) / gpu_mem
        gpu_streamed = gpu_update + (n * (8 + d) / gpu_mem if summed else 0.0)
        host_h2d, host_d2h = loads[name] * n * load_bytes, contributions * n * d  # bytes
        streamed_loads = loads[name] if summed else min(loads[name], 1.0)  # a summed unit's loads read the host
        streamed_h2d = streamed_loads * n * load_bytes + travelling + sum_up
        streamed_d2h = travelling + kept + earlier
        host = {
            "pcie h2d": host_h2d / h2d,
            "pcie d2h": host_d2h / d2h,
            "pcie duplex": (host_h2d + host_d2h) / duplex,
            "host memory": (n * (adam_bytes + d) + (contributions - 1) * n * (8 + d)) / host_mem,
            "cpu": n / adam_rate,
        }
        streamed = {
            "gpu compute": gpu_streamed,
            "pcie h2d": streamed_h2d / h2d,
            "pcie d2h": streamed_d2h / d2h,
            "pcie duplex": (streamed_h2d + streamed_d2h) / duplex,
            # the DMA of master and moments both ways and the kept gradient; the host's sums, as a host
            # unit's (the last contribution is the GPU's), and the sum read once for its upload
            "host memory": (2 * travelling + kept + (contributions - 1) * n * (8 + d) + sum_up) / host_mem,
        }
        costs.append(
            UnitCost(
                name=name,
                numel=n,
                host=host,
                streamed=streamed,
                resident={"gpu compute": gpu_update},
                stream_device_bytes=staging((name,)),
                can_stream=name not in on_nvme,
            )
        )
    return tuple(costs)


StagingPrice = Callable[[Iterable[str]], int]
"""GPU bytes the streamed updates hold to stream the units it is given (:func:`staging_price`)."""


def staging_price(shape: ModelShape, inputs: PlanInputs) -> StagingPrice:
    """The GPU bytes of streaming a set of units, as the engine allocates them (``StreamedPipeline`` and
    the device optimizer report their own sizes): the staging sets sized by the largest unit and the pool
    of summed gradients for those of them that get several contributions a step (the engine's rule,
    ``RunLayout.accumulating``: every unit with accumulation, the tied embedding without; Note [One sum
    per summing unit in flight] in slide_core/engine/sums_pool.py), with clipping the fp32 ``c_u * g`` of
    one transfer chunk, and the device optimizer's scratch for the longest range it steps. 0 for none."""
    from slide_core.engine.streamed_pipeline import StreamedPipeline

    numel = shape.named_numels
    summing = set(inputs.layout(shape).accumulating(inputs.grad_accum))
    arrays, split, sets = inputs.state_arrays(), inputs.master_format == "split", inputs.staging_sets
    chunk, clipping = inputs.transfer_chunk_numel, inputs.clipping
    device_optimizer = inputs.device_optimizer()

    def price(names: Iterable[str]) -> int:
        staged = [name for name in names if name in numel]
        if not staged:
            return 0
        largest = max(numel[name] for name in staged)
        staging = StreamedPipeline.device_bytes(
            largest,
            arrays,
            split=split,
            sets=sets,
            clipping_chunk=chunk if clipping else None,
            summing_numels=[numel[name] for name in staged if name in summing],
        )
        longest = StreamedPipeline.optimizer_range_numel(largest, chunk, clipping=clipping)
        return staging + device_optimizer.device_scratch_bytes(longest)

    return price


def fixed_times(shape: ModelShape, inputs: PlanInputs, compute_s: float, disk_s: float) -> dict[str, float]:
    """The part of each resource no unit's placement changes: the GPU's forward and backward
    (``compute_s``), the activation stash out and back in, NVMe traffic (``disk_s``)."""
    bw = inputs.bandwidths
    stash = shape.num_blocks * inputs.batch_size * inputs.seq_len * shape.activation_width * inputs.compute_dtype_bytes
    stash_bytes = stash * inputs.grad_accum
    return {
        "gpu compute": compute_s,
        "pcie h2d": stash_bytes / (bw.h2d_gbps * 1e9),
        "pcie d2h": stash_bytes / (bw.d2h_gbps * 1e9),
        "pcie duplex": 2 * stash_bytes / (bw.duplex_gbps * 1e9),
        "host memory": 0.0,
        "cpu": 0.0,
        "nvme": disk_s,
    }


def placement_of(name: str, inputs: PlanInputs) -> str:
    if name in inputs.resident_units:
        return "resident"
    return "streamed" if name in inputs.streamed_units else "host"


def resource_times(
    fixed: Mapping[str, float], costs: Sequence[UnitCost], placements: Mapping[str, str]
) -> dict[str, float]:
    """Each resource's seconds per step: ``fixed`` plus every unit's term for its placement (``host``
    where ``placements`` does not name it)."""
    totals = {resource: fixed.get(resource, 0.0) for resource in RESOURCES}
    for cost in costs:
        for resource, seconds in cost.times(placements.get(cost.name, "host")).items():
            totals[resource] += seconds
    return totals
