"""slide_hf/planner/distributed.py: a rank's plan scaled to N ranks on M hosts, against numbers worked out
by hand from the toy shape (docs/distributed.md's scaling model), and `slide plan --nproc-per-node`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.collectives import shard_span
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.testing import PinRecordingDevice, ShardedRank, ToyConfig, ToyModel
from slide_hf.errors import UserError
from slide_hf.planner import Bandwidths, ModelShape, PlanInputs, make_plan
from slide_hf.planner.distributed import Interconnect, plan_data_parallel
from slide_hf.planner.memory import pinned_master_numel

BW = Bandwidths(h2d_gbps=50.0, d2h_gbps=40.0, cpu_adam_gparams=2.0, host_mem_gbps=100.0, gpu_tflops=400.0)


def _shape() -> ModelShape:
    cfg = ToyConfig(vocab_size=8192, hidden_size=512, num_heads=8, intermediate_size=1536, num_layers=4)
    return ModelShape.of(ToyModel(cfg))


@pytest.mark.parametrize(("per_node", "nodes", "accum"), [(8, 1, 1), (8, 8, 1), (3, 2, 2)])
def test_scaling_by_hand(per_node: int, nodes: int, accum: int) -> None:
    shape = _shape()
    inputs = PlanInputs(shape, batch_size=2, seq_len=128, grad_accum=accum, block_slots=2, bandwidths=BW)
    rank = make_plan(inputs)
    link = Interconnect(intra_gbps=100.0, inter_gbps=20.0)
    dp = plan_data_parallel(rank, per_node, nodes, link)
    world = per_node * nodes
    n, d = shape.total_numel, 2  # bf16 compute

    # Host: the largest rank's shards (rank 0's: shards of ceil(numel / N)) of the master, the Adam state
    # and the accumulators, the rest as one process. The master is page-locked stretch by stretch (Note
    # [One registration per allocation]), never a span over the other ranks' shards. The ring carries the
    # backlog of the rank's shards, but keeps its 4 chunks however small they are: as one process's here.
    host = rank.host_breakdown
    numels = [shape.embedding_numel, *shape.block_numels, shape.head_numel]
    shard_numel = sum(-(-numel // world) for numel in numels)
    shards = 4 * shard_numel
    assert dp.host_rank_breakdown["master_fp32"] == shards
    assert host["master_fp32"] // world <= shards < host["master_fp32"] // world + 4 * len(numels)
    assert dp.host_rank_breakdown["optimizer_state"] == 8 * shard_numel
    assert dp.host_rank_breakdown["grad_accumulators"] == (4 * shard_numel if accum > 1 else 0)
    chunk = inputs.transfer_chunk_numel
    ring_slots = max(4, math.ceil(0.5 * shard_numel / chunk))
    assert dp.host_rank_breakdown["grad_ring"] == ring_slots * chunk * d == host["grad_ring"]
    sharded = ("master_fp32", "optimizer_state", "grad_accumulators", "grad_ring")
    unchanged = sum(v for k, v in host.items() if k not in sharded)
    assert dp.host_per_rank_bytes == unchanged + sum(dp.host_rank_breakdown[k] for k in sharded)
    assert dp.host_per_host_bytes == per_node * dp.host_per_rank_bytes
    assert dp.gpu_peak_bytes == rank.gpu_peak_bytes

    # PCIe: loads per step = embedding + head + 2 x 4 blocks x accum - (2 accum - 1) x 2 slots (blocks that
    # stay in their slot between forward and backward); each loads its shard of the fp32 master.
    block = (n - shape.embedding_numel - shape.head_numel) / 4
    loads = shape.embedding_numel + shape.head_numel + (8 * accum - (2 * accum - 1) * 2) * block
    stash = 4 * 2 * 128 * 512 * d * accum
    grads = accum * n * d
    h2d_s = (4 * loads / world + stash) / 50e9
    d2h_s = (grads / world + stash) / 40e9
    duplex_s = (4 * loads / world + grads / world + 2 * stash) / (1.2 * 40e9)  # both ways: 1.2 x the slower
    assert dp.pcie_s == pytest.approx(max(h2d_s, d2h_s, duplex_s), rel=1e-12)

    # The host optimizer of one host: its share of the parameters.
    assert dp.update_s == pytest.approx(rank.update_s / nodes, rel=1e-12)

    # The interconnect: (N-1)/N of every all-gather (bf16 loads) and reduce-scatter (bf16 gradients).
    link_bytes = (loads * d + grads) * (world - 1) / world
    assert dp.interconnect_bytes == pytest.approx(link_bytes, rel=1e-12)
    assert dp.interconnect_s == pytest.approx(link_bytes / (100e9 if nodes == 1 else 20e9), rel=1e-12)

    own = max(dp.compute_s, dp.pcie_s, dp.update_s, dp.disk_s)  # ordered as one process orders them
    ordering = rank.step_time_s / rank.resource_bound_s
    assert dp.step_time_s == pytest.approx(max(own * ordering, dp.interconnect_s), rel=1e-12)
    assert dp.compute_s == rank.compute_s
    assert dp.tokens_per_step == world * 2 * 128 * accum


@pytest.mark.parametrize("master_format", ["fp32", "split"])
@pytest.mark.parametrize(("rank", "world"), [(0, 1), (0, 2), (1, 2), (2, 3)])
@pytest.mark.parametrize("resident", [("block.1",), ("embedding", "block.2")])
def test_the_pinned_master_is_what_the_engine_page_locks(
    rank: int, world: int, resident: tuple[str, ...], master_format: str
) -> None:
    """Plan == engine, rank by rank: the elements of the copied plane the planner prices as page-locked
    are those the engine registers, resident units inside a span included (one process) or not (ranks)."""
    cfg = ToyConfig(vocab_size=512, hidden_size=64, num_heads=4, intermediate_size=128, num_layers=3)
    model = ToyModel(cfg)
    names = {"embedding": "embed", "block.1": "layers.1", "block.2": "layers.2"}
    on_device = tuple(names[name] for name in resident)
    dtype = torch.bfloat16 if master_format == "split" else torch.float32
    config = EngineConfig(compute_dtype=dtype, master_format=master_format, resident_units=on_device)
    host_units = [unit for unit in model.units if unit.name not in on_device]
    with PinRecordingDevice() as device, ShardedRank(rank, world) as collectives:
        host = HostParameters(model, master_format=master_format)
        with Engine(model, device, host, TorchAdamW(AdamWConfig()), config, process_group=collectives):
            h2d_plane = host.store.h2d_plane.untyped_storage().data_ptr()
            pinned = [t for t in device.pinned if t.untyped_storage().data_ptr() == h2d_plane]
            first, last = host.offset(host_units[0]), host.extent(host_units[-1])[1]
    locked = sum(t.numel() for t in pinned)
    if world == 1:  # one span, the resident units between the first host-updated unit and the last included
        assert len(pinned) == 1 and locked == last - first
    else:  # one span per shard (none is contiguous with the next): no resident unit, no other rank's shard
        assert len(pinned) == len(host_units)
        assert locked == sum(hi - lo for unit in host_units for lo, hi in [shard_span(unit.layout.numel, rank, world)])
    shape = ModelShape.of(model)
    inputs = PlanInputs(shape, resident_units=resident, master_format=master_format)
    assert pinned_master_numel(shape, inputs, rank, world) == locked


def test_the_clipping_store_is_sharded() -> None:
    """A rank keeps only its shards of the step's gradient (slide_core/engine/grad_ring.py, GradStore)."""
    shape = _shape()
    rank = make_plan(PlanInputs(shape, batch_size=2, seq_len=128, max_grad_norm=1.0, bandwidths=BW))
    shards = sum(-(-numel // 4) for numel in shape.unit_numels)  # rank 0's, the longest
    assert plan_data_parallel(rank, 4).host_rank_breakdown["grad_ring"] == 2 * shards  # bf16
    assert rank.host_breakdown["grad_ring"] == 2 * shape.total_numel


def test_one_rank_is_the_single_process_plan() -> None:
    rank = make_plan(PlanInputs(_shape(), batch_size=2, seq_len=128, bandwidths=BW))
    dp = plan_data_parallel(rank, 1, 1)
    assert dp.host_per_host_bytes == dp.host_per_rank_bytes == sum(rank.host_breakdown.values())
    assert dp.pcie_s == pytest.approx(rank.pcie_s, rel=1e-12)
    assert dp.interconnect_s == 0 and dp.step_time_s == pytest.approx(rank.step_time_s, rel=1e-12)


@pytest.mark.parametrize(("world", "link_gbps"), [(1, 100.0), (4, 100.0), (4, 0.01)])
def test_the_reference_pass_of_ranks_by_hand(world: int, link_gbps: float) -> None:
    """DPO's reference pass under data parallel (Note [The ranks share the reference pass]): each rank runs
    its share of the pairs at one process's compute, copies only its shard of each load up and all-gathers
    the rest; a slow link makes the gathers bind."""
    from slide_hf.planner.timing import eval_group_size

    shape = _shape()
    inputs = PlanInputs(shape, batch_size=2, seq_len=128, grad_accum=2, objective="dpo", bandwidths=BW)
    rank = make_plan(inputs)
    dp = plan_data_parallel(rank, world, 1, Interconnect(intra_gbps=link_gbps))
    tokens, attn = 2 * 128 * 2, shape.num_heads * shape.head_dim * 128
    head = shape.vocab_size * shape.hidden_size
    compute_s = tokens * (2 * shape.block_params + 2 * head + 4 * shape.num_blocks * attn) / 400e12
    loaded = 2 * shape.total_numel / eval_group_size(shape, inputs)  # no resident unit without a GPU budget
    loads_s = loaded * 4 / world / 50e9  # fp32 master
    gathers_s = loaded * 2 * (world - 1) / world / (link_gbps * 1e9)
    assert dp.reference_step_s == pytest.approx(max(compute_s, loads_s, gathers_s), rel=1e-12)
    if world == 1:
        assert dp.reference_step_s == pytest.approx(rank.reference_step_s, rel=1e-12)
    if link_gbps < 1:
        assert dp.reference_step_s == pytest.approx(gathers_s, rel=1e-12)
    assert plan_data_parallel(make_plan(PlanInputs(shape, bandwidths=BW)), world).reference_step_s is None


def test_bad_counts_are_one_line() -> None:
    rank = make_plan(PlanInputs(_shape()))
    with pytest.raises(UserError, match="--nproc-per-node and --nnodes must be >= 1, got 0 and 1"):
        plan_data_parallel(rank, 0, 1)
    with pytest.raises(UserError, match="interconnect inter_gbps must be > 0"):
        Interconnect(inter_gbps=0)


def test_slide_plan_prices_the_ranks(capsys) -> None:
    from slide_hf.cli.main import main

    args = ["plan", "--model", "tiny-llama", "--gpu-memory", "80GiB", "--host-memory", "1TiB"]
    assert main([*args, "--nproc-per-node", "8", "--nnodes", "2", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    dp = payload["data_parallel"]
    assert (dp["nproc_per_node"], dp["nnodes"], dp["world_size"]) == (8, 2, 16)
    assert dp["host_per_host_bytes"] == 8 * dp["host_per_rank_bytes"]
    units = len(payload["placement"]["host"])  # rank 0's shards: at most one element longer than 1/16 each
    state = payload["host_breakdown"]["optimizer_state"]
    assert state // 16 <= dp["host_rank_breakdown"]["optimizer_state"] <= state // 16 + 8 * units
    assert main([*args, "--nproc-per-node", "4"]) == 0
    text = capsys.readouterr().out
    assert "data parallel" in text and "4 ranks (4 per host x 1 host)" in text
