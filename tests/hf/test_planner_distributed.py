"""slide_hf/planner/distributed.py: a rank's plan scaled to N ranks on M hosts, against numbers worked out
by hand from the toy shape (docs/distributed.md's scaling model), and `slide plan --nproc-per-node`."""

from __future__ import annotations

import json

import pytest

from slide_core.collectives import shard_span
from slide_core.testing import ToyConfig, ToyModel
from slide_hf.errors import UserError
from slide_hf.planner import Bandwidths, ModelShape, PlanInputs, make_plan
from slide_hf.planner.distributed import Interconnect, plan_data_parallel

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

    # Host: the Adam state, accumulators and gradient ring 1/N, the rest as one process; the fp32 master is
    # one page-locked span from the rank's shard of the embedding to its shard of the head (Note [One
    # registration per allocation]): all of it but what lies before the first shard and after the last.
    host = rank.host_breakdown
    spans = [
        n
        - shard_span(shape.embedding_numel, r, world)[0]
        - (shape.head_numel - shard_span(shape.head_numel, r, world)[1])
        for r in range(world)
    ]
    assert dp.host_rank_breakdown["master_fp32"] == 4 * max(spans) > host["master_fp32"] // world
    assert dp.host_rank_breakdown["optimizer_state"] == 8 * n // world
    assert dp.host_rank_breakdown["grad_accumulators"] == (4 * n if accum > 1 else 0) // world
    assert dp.host_rank_breakdown["grad_ring"] == host["grad_ring"] // world
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
    assert dp.pcie_s == pytest.approx(max(h2d_s, d2h_s), rel=1e-12)

    # The host optimizer of one host: its share of the parameters.
    assert dp.update_s == pytest.approx(rank.update_s / nodes, rel=1e-12)

    # The interconnect: (N-1)/N of every all-gather (bf16 loads) and reduce-scatter (bf16 gradients).
    link_bytes = (loads * d + grads) * (world - 1) / world
    assert dp.interconnect_bytes == pytest.approx(link_bytes, rel=1e-12)
    assert dp.interconnect_s == pytest.approx(link_bytes / (100e9 if nodes == 1 else 20e9), rel=1e-12)

    limits = [dp.compute_s, dp.pcie_s, dp.update_s, dp.disk_s, dp.interconnect_s]
    assert dp.step_time_s == max(limits) and dp.compute_s == rank.compute_s
    assert dp.tokens_per_step == world * 2 * 128 * accum


def test_the_clipping_store_is_sharded() -> None:
    """A rank keeps only its shards of the step's gradient (slide_core/engine/grad_ring.py, GradStore)."""
    rank = make_plan(PlanInputs(_shape(), batch_size=2, seq_len=128, clipping=True, bandwidths=BW))
    assert plan_data_parallel(rank, 4).host_rank_breakdown["grad_ring"] == rank.host_breakdown["grad_ring"] // 4


def test_one_rank_is_the_single_process_plan() -> None:
    rank = make_plan(PlanInputs(_shape(), batch_size=2, seq_len=128, bandwidths=BW))
    dp = plan_data_parallel(rank, 1, 1)
    assert dp.host_per_host_bytes == dp.host_per_rank_bytes == sum(rank.host_breakdown.values())
    assert dp.pcie_s == pytest.approx(rank.pcie_s, rel=1e-12)
    assert dp.interconnect_s == 0 and dp.step_time_s == pytest.approx(rank.step_time_s, rel=1e-12)


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
    assert dp["host_rank_breakdown"]["optimizer_state"] == payload["host_breakdown"]["optimizer_state"] // 16
    assert main([*args, "--nproc-per-node", "4"]) == 0
    text = capsys.readouterr().out
    assert "data parallel" in text and "4 ranks (4 per host x 1 host)" in text
