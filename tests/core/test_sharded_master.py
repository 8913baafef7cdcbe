"""``HostParameters.keep_shards`` (Note [Sharded master] in slide_core/engine/host_pipeline.py): writes
through ``write``, ``editing`` and ``overwriting`` land in the rank's shards only, in either master format (the rest keeps
whatever the allocation held), and the pages outside them never become resident, so a rank's master
costs it its shard's bytes."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

from slide_core.distributed import shard_span
from slide_core.host_params import HostParameters
from slide_core.testing import ToyConfig, ToyModel, toy_init


def _spans(model: ToyModel, rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    return {unit.name: shard_span(unit.layout.numel, rank, world_size) for unit in model.units}


@pytest.mark.parametrize("writer", ["editing", "overwriting"])
@pytest.mark.parametrize("master_format", ["fp32", "split"])
def test_writes_land_in_the_shards_only(master_format: str, writer: str) -> None:
    model = ToyModel(ToyConfig(num_layers=2))
    init = toy_init(model, seed=3)
    whole = HostParameters(model, master_format=master_format)
    for unit in model.units:
        with whole.editing(unit) as views:
            for name, view in views.items():
                view.copy_(init[unit.name][name])
    spans = _spans(model, 1, 3)
    host = HostParameters(model, master_format=master_format)
    host.keep_shards(spans)
    before = {unit.name: host.read(unit).clone() for unit in model.units}  # whatever the allocation held
    for unit in model.units:
        with getattr(host, writer)(unit) as views:  # loading and random init write this way
            for name, view in views.items():
                view.copy_(init[unit.name][name])
    unit = model.blocks[0]
    host.write(unit, torch.full((10,), 7.0), spans[unit.name][0] - 5)  # straddles the shard's start
    for unit in model.units:
        lo, hi = spans[unit.name]
        got, want = host.read(unit), whole.read(unit)
        was = before[unit.name].view(torch.int32)
        assert torch.equal(got.view(torch.int32)[:lo], was[:lo]), unit.name  # bit for bit (NaN included)
        assert torch.equal(got.view(torch.int32)[hi:], was[hi:]), unit.name
        if unit is model.blocks[0]:
            assert torch.equal(got[lo : lo + 5], torch.full((5,), 7.0))
            lo += 5
        assert torch.equal(got[lo:hi], want[lo:hi]), unit.name


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def test_a_sharded_master_costs_its_shard() -> None:
    """A 235 MB fp32 master loaded as rank 0 of 4 adds about a quarter of that to the process's resident
    memory; loaded whole, all of it."""
    model = ToyModel(ToyConfig(vocab_size=16384, hidden_size=1024, num_heads=8, intermediate_size=4096, num_layers=2))
    ones = {unit.name: torch.ones(unit.layout.numel) for unit in model.units}

    def loaded_bytes(spans: dict[str, tuple[int, int]] | None) -> int:
        host = HostParameters(model)
        if spans is not None:
            host.keep_shards(spans)
        before = _rss()
        for unit in model.units:
            host.write(unit, ones[unit.name])
        grown = _rss() - before
        del host
        return grown

    whole_bytes = 4 * sum(unit.layout.numel for unit in model.units)
    assert loaded_bytes(None) > 0.9 * whole_bytes
    assert loaded_bytes(_spans(model, 0, 4)) < 0.35 * whole_bytes
