"""slide_core/allocation_ledger.py: what a ledger counts is the storages it was handed, for as long as they
live, less the ranges left untouched, plus what the objects it reads hold; and a data-parallel rank's
engine counts its own shards of the master, the state and the accumulators."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.allocation_ledger import AllocationLedger, held_host_bytes
from slide_core.collectives import shard_span
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.testing import ShardedRank, ToyConfig, ToyModel, load_init, toy_init


class _Owner:
    pass


def test_a_storage_counts_once_while_it_lives() -> None:
    ledger = AllocationLedger()
    slab = ledger.record(_Owner(), "grad_ring", torch.empty(1000, dtype=torch.bfloat16))
    ledger.record(_Owner(), "grad_ring", slab[10:20])  # a view of it: the same allocation
    ledger.record(_Owner(), "grad_norms", torch.empty(3, dtype=torch.float32))  # freed at once
    gc.collect()
    reading = ledger.reading()
    assert dict(reading.buffers) == {"grad_ring": 2000}
    assert dict(reading.owners["grad_ring"]) == {"_Owner": 2000}
    assert reading.allocations["grad_ring"] == 2 and reading.allocations["grad_norms"] == 1
    del slab
    gc.collect()
    assert dict(ledger.reading().buffers) == {}


def test_untouched_ranges_are_taken_off_and_other_devices_are_not_host_memory() -> None:
    ledger = AllocationLedger()
    state = ledger.record(_Owner(), "optimizer_state", torch.empty(4096))
    ledger.leave_untouched(state[:1024])
    ledger.leave_untouched(state[1024:], nbytes=100)
    ledger.leave_untouched(torch.empty(8))  # not recorded: ignored
    ledger.record(_Owner(), "optimizer_state", torch.empty(64, device="meta"))
    reading = ledger.reading()
    assert reading.buffers["optimizer_state"] == 4 * 4096 - 4 * 1024 - 100
    assert reading.untouched["optimizer_state"] == 4 * 1024 + 100
    assert state.numel() == 4096


def test_what_an_object_holds_is_read_when_the_ledger_is() -> None:
    class Scratch:
        def __init__(self) -> None:
            self.buffers: dict[str, torch.Tensor] = {}
            self.flags = np.empty(0, dtype=np.uint8)

    scratch = Scratch()
    ledger = AllocationLedger()
    ledger.hold(scratch, "optimizer_scratch", lambda: held_host_bytes(scratch))
    assert ledger.reading().buffers["optimizer_scratch"] == 0
    whole = torch.empty(256)
    scratch.buffers = {"a": whole, "b": whole[:16], "nested": [whole[8:]]}  # one storage, three views
    scratch.flags = np.empty(100, dtype=np.uint8)[10:]  # a view: its whole array counts
    assert ledger.reading().buffers["optimizer_scratch"] == 4 * 256 + 100


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (0, 2), (1, 2)])
@pytest.mark.parametrize("master_format", ["fp32", "split"])
def test_a_rank_counts_its_shards(rank: int, world: int, master_format: str) -> None:
    """Each rank holds its shards of every plane of the master, of the state slabs and of the accumulators,
    counted on the engine's own tensors, and the units kept on the device cost the host nothing."""
    model = ToyModel(ToyConfig(vocab_size=512, hidden_size=64, num_heads=4, intermediate_size=128, num_layers=3))
    dtype = torch.bfloat16 if master_format == "split" else torch.float32
    # The ranks' collectives do nothing here, so the slots outside a shard hold whatever they held: the
    # values are not this test's business, and non-finite ones must not stop the step.
    config = EngineConfig(
        compute_dtype=dtype, master_format=master_format, transfer_chunk_numel=4096, skip_nonfinite=False
    )
    optimizer = TorchAdamW(AdamWConfig())
    with CPUDevice() as device, ShardedRank(rank, world) as collectives:
        host = HostParameters(model, master_format=master_format)
        load_init(host, toy_init(model, seed=0))
        with Engine(model, device, host, optimizer, config, process_group=collectives) as engine:
            ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
            engine.step([(ids, ids.clone()), (ids, ids.clone())], lr=1e-3)
            engine.wait_idle()
            counted = engine.host_allocations
    shards = [hi - lo for unit in model.units for lo, hi in [shard_span(unit.layout.numel, rank, world)]]
    ties = sum(-(-hi // 8) - lo // 8 for unit in model.units for lo, hi in [shard_span(unit.layout.numel, rank, world)])
    master = 4 * sum(shards) if master_format == "fp32" else 4 * sum(shards) + ties
    assert counted.buffers["master_fp32"] == master
    assert counted.buffers["optimizer_state"] == 8 * sum(shards)  # fp32 m and v
    assert counted.buffers["grad_accumulators"] == 4 * sum(shards)  # two micro-batches: every unit sums
    assert counted.untouched.get("master_fp32", 0) == host.nbytes - master
