"""Data parallel on paper: per-GPU memory, per-host RAM and the step-time bound of N ranks on M hosts.

Built on the single-process :class:`~slide_hf.planner.plan.Plan` of one rank (its per-rank batch), by what
the sharded engine changes (slide_core/engine/host_pipeline.py, docs/distributed.md):

- GPU: unchanged. Every rank slides the whole model through the same slots and buffers.
- Host, per rank: every engine buffer as its owner prices it for the rank that holds the most
  (:func:`~slide_hf.planner.memory.engine_buffers` with the world size, what each rank's engine counts):
  its shards of the fp32 master, the Adam state and the fp32 gradient accumulators (a rank loads, updates
  and writes only its shards, so the rest of those buffers is never touched: Note [Sharded master] in
  slide_core/engine/host_pipeline.py; the master's page-locked spans hold its shards only, one span per
  contiguous stretch of them: Note [One registration per allocation] in slide_core/engine/host_span.py),
  the pinned gradient ring or clipping store of its shards (the store holds them; the ring, the backlog of
  them, but never fewer than ``EngineConfig.grad_ring_slots`` chunks, so a small model's ring is as large
  as one process's), the rest as one process (activation stash, scratch, the tiers, the process itself).
  Per host: that, times the ranks on the host. The final drain gathers the whole master on every rank for
  the export, which this does not count.
- PCIe, per GPU: each load copies only the rank's shard of the master up (the all-gather fills the rest),
  and only the reduced shard of each gradient comes down, so the parameter and gradient bytes are 1/N of
  one process's; the activation stash crosses as in one process. Each direction at its rate, and both
  together at the duplex rate (``Bandwidths.duplex_gbps``), as in one process.
- Host optimizer, per host: its ranks update ``ranks_per_host / N`` of the parameters, so one process's
  update time divided by the number of hosts.
- Interconnect, per GPU: every gradient contribution is reduce-scattered and every load all-gathered in
  the compute dtype; a ring moves ``(N - 1) / N`` of each buffer through every rank's link, at
  ``intra_gbps`` on one host and at ``inter_gbps`` (each GPU's share of the host's network) on several.

The step-time bound is the slowest of compute, PCIe, the host optimizer, NVMe and the interconnect,
assuming they overlap perfectly, as the single-process plan does. A planning number, not a benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slide_hf.errors import UserError
from slide_hf.planner.inputs import ModelShape, PlanInputs
from slide_hf.planner.memory import engine_buffers
from slide_hf.planner.plan import Plan
from slide_hf.planner.timing import reference_pass
from slide_hf.planner.traffic import block_loads, h2d_bytes_per_param
from slide_hf.planner.unit_costs import placement_of
from slide_hf.sizes import format_bytes

__all__ = [
    "DataParallelPlan",
    "Interconnect",
    "plan_data_parallel",
    "ranks_reference_step_s",
    "render_data_parallel",
]


@dataclass(frozen=True)
class Interconnect:
    """Collective bandwidth per GPU, in GB/s (1e9 bytes/s), as a ring all-gather sees it.

    The defaults are stated, not measured: ``intra_gbps`` 150 (NVLink-class GPUs on one host; PCIe-only
    hosts are nearer 20), ``inter_gbps`` 25 (a 200 Gb/s NIC per GPU)."""

    intra_gbps: float = 150.0
    inter_gbps: float = 25.0

    def __post_init__(self) -> None:
        for name in ("intra_gbps", "inter_gbps"):
            if not getattr(self, name) > 0:
                raise UserError(f"interconnect {name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class DataParallelPlan:
    """One rank's plan (``rank``) scaled to ``nproc_per_node`` ranks on each of ``nnodes`` hosts."""

    rank: Plan = field(repr=False)
    nproc_per_node: int
    nnodes: int
    interconnect: Interconnect
    gpu_peak_bytes: int
    """Per GPU: one process's peak (the sharded engine adds no device buffer)."""
    host_rank_breakdown: dict[str, int]
    """Host bytes of one rank, by buffer."""
    host_per_rank_bytes: int
    host_per_host_bytes: int
    compute_s: float
    pcie_s: float
    update_s: float
    """The host optimizer of one host: its ranks' share of the parameters."""
    disk_s: float
    interconnect_s: float
    interconnect_bytes: float
    """Bytes through each GPU's link per step (the ring's ``(N - 1) / N`` of every collective)."""
    step_time_s: float
    """The larger of the interconnect's time and the largest of the others times the single process's
    ordering cost (its plan's step over its largest resource, ``Plan.resource_bound_s``)."""
    binding: str
    reference_step_s: float | None = None
    """DPO's reference pass over one rank's step's worth of pairs, each rank its share (Note [The ranks share
    the reference pass] in slide_hf/preference/reference.py): the rank's forward compute, its shard of
    each load over PCIe and the all-gather of the rest, which overlap; None for other objectives."""

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def tokens_per_step(self) -> int:
        return self.rank.tokens_per_step * self.world_size

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s if self.step_time_s > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {
            "nproc_per_node": self.nproc_per_node,
            "nnodes": self.nnodes,
            "world_size": self.world_size,
            "intra_gbps": self.interconnect.intra_gbps,
            "inter_gbps": self.interconnect.inter_gbps,
            "gpu_peak_bytes": self.gpu_peak_bytes,
            "host_per_rank_bytes": self.host_per_rank_bytes,
            "host_per_host_bytes": self.host_per_host_bytes,
            "host_rank_breakdown": dict(self.host_rank_breakdown),
            "tokens_per_step": self.tokens_per_step,
            "compute_s": self.compute_s,
            "pcie_s": self.pcie_s,
            "update_s": self.update_s,
            "disk_s": self.disk_s,
            "interconnect_s": self.interconnect_s,
            "interconnect_bytes": self.interconnect_bytes,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "binding": self.binding,
            "reference_step_s": self.reference_step_s,
        }


def plan_data_parallel(
    rank: Plan, nproc_per_node: int, nnodes: int = 1, interconnect: Interconnect | None = None
) -> DataParallelPlan:
    """Scale ``rank`` (the plan of one rank at its per-rank batch) to ``nproc_per_node`` x ``nnodes``
    ranks; see the module docstring for each number."""
    if nproc_per_node < 1 or nnodes < 1:
        raise UserError(f"--nproc-per-node and --nnodes must be >= 1, got {nproc_per_node} and {nnodes}")
    link = interconnect or Interconnect()
    world = nproc_per_node * nnodes
    inputs, shape = rank.inputs, rank.shape
    # Each buffer by its owner's rule for one rank's shards, not as one process's figure over N: the ring
    # keeps its least number of chunks whatever the shard, and the master's page-locked span counts the
    # resident units inside it in one process only (with two ranks or more a resident unit always has
    # other ranks' shards beside it, so no rank's span keeps it).
    breakdown = {**rank.host_breakdown, **engine_buffers(shape, inputs, world).host}
    per_rank = sum(breakdown.values())
    params_h2d, stash, grads = _pcie_parts(shape, inputs)
    bw = inputs.bandwidths
    pcie_s = max(
        (params_h2d / world + stash) / (bw.h2d_gbps * 1e9),
        (grads / world + stash) / (bw.d2h_gbps * 1e9),
        (params_h2d / world + grads / world + 2 * stash) / (bw.duplex_gbps * 1e9),  # both at once
    )
    d = inputs.compute_dtype_bytes
    params_loaded = params_h2d / h2d_bytes_per_param(inputs.master_format)
    collective_bytes = params_loaded * d + grads  # all-gathers + reduce-scatters
    link_bytes = collective_bytes * (world - 1) / world
    gbps = link.intra_gbps if nnodes == 1 else link.inter_gbps
    interconnect_s = link_bytes / (gbps * 1e9)
    limits = {
        "gpu compute": rank.compute_s,
        "pcie": pcie_s,
        "host memory bandwidth": rank.update_s / nnodes,
        "nvme": rank.disk_s / nnodes,
        "interconnect": interconnect_s,
    }
    binding = max(limits, key=limits.__getitem__)
    # The schedule (slide_hf/planner/step_schedule.py) runs one process's order; a rank keeps that order,
    # so its step stands to its largest own resource as the single process's does. The collectives are
    # not in that order: they bound the step as they are.
    ordering = rank.step_time_s / rank.resource_bound_s if rank.resource_bound_s > 0 else 1.0
    own = max(t for name, t in limits.items() if name != "interconnect")
    return DataParallelPlan(
        rank=rank,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        interconnect=link,
        gpu_peak_bytes=rank.gpu_peak_bytes,
        host_rank_breakdown=breakdown,
        host_per_rank_bytes=per_rank,
        host_per_host_bytes=per_rank * nproc_per_node,
        compute_s=rank.compute_s,
        pcie_s=pcie_s,
        update_s=rank.update_s / nnodes,
        disk_s=rank.disk_s / nnodes,
        interconnect_s=interconnect_s,
        interconnect_bytes=link_bytes,
        step_time_s=max(own * ordering, interconnect_s),
        binding=binding,
        reference_step_s=ranks_reference_step_s(rank, world, gbps) if inputs.objective == "dpo" else None,
    )


def ranks_reference_step_s(rank: Plan, world: int, link_gbps: float) -> float:
    """The reference pass of one rank's pairs: its compute as one process's; each evaluation load copies
    the rank's shard of every sliding unit up and all-gathers the rest in the compute dtype (a ring:
    ``(N - 1) / N`` of it through each link)."""
    inputs, shape = rank.inputs, rank.shape
    placements = {name: placement_of(name, inputs) for name in shape.names}
    parts = reference_pass(shape, inputs, placements)
    loads_s = parts.load_bytes / world / (inputs.bandwidths.h2d_gbps * 1e9)
    gather_s = parts.loaded_params * inputs.compute_dtype_bytes * (world - 1) / world / (link_gbps * 1e9)
    return max(parts.compute_s, loads_s, gather_s)


def _pcie_parts(shape: ModelShape, inputs: PlanInputs) -> tuple[float, float, float]:
    """One process's PCIe bytes per step, as the single-process timing counts them: the parameters' h2d
    (fp32 from the master), the activation stash (each way), the gradients' d2h (compute dtype)."""
    d, accum = inputs.compute_dtype_bytes, inputs.grad_accum
    layers = shape.num_blocks
    mean_block = sum(shape.block_numels) / layers if layers else 0.0
    loads = shape.embedding_numel + shape.head_numel + block_loads(shape, inputs) * mean_block
    stash = layers * inputs.batch_size * inputs.seq_len * shape.activation_width * d * accum
    grad_numel = shape.total_numel + (shape.embedding_numel if shape.tied else 0)
    return h2d_bytes_per_param(inputs.master_format) * loads, float(stash), float(accum * grad_numel * d)


def render_data_parallel(dp: DataParallelPlan) -> str:
    """The lines `slide plan --nproc-per-node N` adds below the one-rank table."""
    hosts = "host" if dp.nnodes == 1 else "hosts"
    link = (
        f"{dp.interconnect.intra_gbps:g} GB/s on one host"
        if dp.nnodes == 1
        else (f"{dp.interconnect.inter_gbps:g} GB/s per GPU between hosts")
    )
    rows = [
        ("data parallel", f"{dp.world_size} ranks ({dp.nproc_per_node} per host x {dp.nnodes} {hosts})", ""),
        ("  GPU peak", format_bytes(dp.gpu_peak_bytes), "per GPU, as one process"),
        ("  host per rank", format_bytes(dp.host_per_rank_bytes), "fp32 master and Adam state 1/N"),
        ("  host per host", format_bytes(dp.host_per_host_bytes), f"{dp.nproc_per_node} ranks"),
        (
            "  step time",
            f"{dp.step_time_s:.3g} s",
            f"compute {dp.compute_s:.3g} s, pcie {dp.pcie_s:.3g} s, host update {dp.update_s:.3g} s, "
            f"interconnect {dp.interconnect_s:.3g} s ({link}); {dp.tokens_per_s:,.0f} tokens/s",
        ),
        ("  binding limit", dp.binding, ""),
    ]
    if dp.reference_step_s is not None:
        rows.append(
            (
                "  reference pass",
                f"{dp.reference_step_s:.3g} s",
                "per step's worth of pairs, each rank its share (--objective dpo, once before the first step)",
            )
        )
    lines = []
    for label, value, note in rows:
        text = f"{label:<22}{value:>12}"
        lines.append(f"{text}   {note}" if note else text)
    return "\n".join(lines)
