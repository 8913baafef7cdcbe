"""slide_core/engine/host_span.py: an unpinned master is page-locked over this rank's host-updated shards,
joined into one span where they are contiguous or where only resident units lie between them (Note [One
registration per allocation]): one span in one process, one per stretch of a rank's shards under data
parallelism. The resident units' pages inside a span are kept while those outside are given back.

The device is the CPU one with ``pin_host_range`` recorded; a rank of two is a one-process world whose
shards are a rank's (what building the engine asks of its collectives)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.collectives import SingleProcess, shard_span
from slide_core.engine import Engine, EngineConfig
from slide_core.engine.host_span import outside, pinned_spans
from slide_core.optim import TorchAdamW
from slide_core.testing import PinRecordingDevice, ToyConfig, ToyModel, load_init, toy_batches, toy_init

_CFG = ToyConfig(vocab_size=2048, hidden_size=128, num_heads=4, intermediate_size=256, num_layers=4)
_PAGES = slice(4096, -4096)  # whole pages of a unit's range, whatever the slab's alignment (elements of <= 4 B)


class _RankOfTwo(SingleProcess):
    """Rank ``rank`` of a world of two, for the shards an engine is built with; its collectives do nothing."""

    world_size = 2

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def span(self, numel: int) -> tuple[int, int]:
        return shard_span(numel, self.rank, self.world_size)


@contextlib.contextmanager
def _engine(
    resident: tuple[str, ...],
    master_format: str = "fp32",
    group: SingleProcess | None = None,
    streamed: tuple[str, ...] = (),
) -> Iterator[tuple[PinRecordingDevice, HostParameters, dict[str, torch.Tensor], Engine]]:
    """An engine over an unpinned master loaded with a seeded init; also yields every unit's copied plane
    as loaded, before the engine gave any page back."""
    model = ToyModel(_CFG)
    dtype = torch.bfloat16 if master_format == "split" else torch.float32
    config = EngineConfig(
        compute_dtype=dtype,
        master_format=master_format,
        transfer_chunk_numel=4096,
        resident_units=resident,
        streamed_units=streamed,
    )
    with PinRecordingDevice() as device, group or SingleProcess() as collectives:
        host = HostParameters(model, master_format=master_format)
        load_init(host, toy_init(model, seed=3))
        loaded = {unit.name: host.h2d_source(unit).clone() for unit in model.units}
        with Engine(model, device, host, TorchAdamW(AdamWConfig()), config, process_group=collectives) as engine:
            yield device, host, loaded, engine


def _assert_spans(device: PinRecordingDevice, host: HostParameters, *spans: tuple[int, int]) -> None:
    """The copied plane is registered over exactly its elements ``spans``, in that order."""
    h2d_plane = host.store.h2d_plane.untyped_storage().data_ptr()
    pinned = [tensor for tensor in device.pinned if tensor.untyped_storage().data_ptr() == h2d_plane]
    wanted = [host.h2d_span(start, end) for start, end in spans]
    assert [(t.data_ptr(), t.numel(), t.dtype) for t in pinned] == [(t.data_ptr(), t.numel(), t.dtype) for t in wanted]


def _assert_one_span(device: PinRecordingDevice, host: HostParameters, start: int, end: int) -> None:
    """One registration per allocation, and the copied plane's is its elements ``[start, end)``."""
    allocations = [tensor.untyped_storage().data_ptr() for tensor in device.pinned]
    assert len(allocations) == len(set(allocations)), "two registrations in one allocation"
    _assert_spans(device, host, (start, end))


def _given_back(tensor: torch.Tensor) -> bool:
    return not tensor[_PAGES].any()


def test_resident_blocks_between_streamed_units_are_kept_inside_the_one_span() -> None:
    """Gemma 3's default placement: a streamed embedding, resident blocks 0-1, then streamed blocks and
    head: one span from the embedding to the head, and the resident blocks' pages inside it stay, through
    a drain and the release at the next step."""
    with _engine(("layers.0", "layers.1")) as (device, host, loaded, engine):
        _assert_one_span(device, host, host.offset("embed"), host.extent("head")[1])
        for name in ("layers.0", "layers.1"):
            assert torch.equal(host.h2d_source(name), loaded[name]), f"{name}'s locked pages were given back"
        batches = toy_batches(_CFG, steps=2, accum=1, seed=5)
        engine.step(batches[0], lr=1e-3)
        engine.drain()
        drained = host.flat("layers.0").clone()
        assert torch.equal(drained, engine.residents.units["layers.0"].master)
        engine.step(batches[1], lr=1e-3)  # the release after a drain keeps them too
        assert torch.equal(host.flat("layers.0"), drained)
        assert len(device.pinned) == 1  # no plane but the copied one, no second range of it


def test_resident_units_at_both_ends_are_given_back() -> None:
    with _engine(("embed", "layers.0", "head")) as (device, host, _, engine):
        _assert_one_span(device, host, host.offset("layers.1"), host.extent("layers.3")[1])
        for name in ("embed", "layers.0", "head"):
            assert _given_back(host.flat(name)), f"{name} lies outside the span and was not given back"
        engine.step(toy_batches(_CFG, steps=1, accum=1, seed=5)[0], lr=1e-3)
        engine.drain()
        assert torch.equal(host.flat("head"), engine.residents.units["head"].master)
        engine.step(toy_batches(_CFG, steps=1, accum=1, seed=6)[0], lr=1e-3)
        assert _given_back(host.flat("head"))


def test_a_split_master_registers_its_bf16_plane_only() -> None:
    """Only the plane the copy reads is registered; a resident unit inside the span keeps its bf16 pages
    and gives back its low bits, which never cross PCIe."""
    with _engine(("layers.1",), master_format="split") as (device, host, loaded, _):
        _assert_one_span(device, host, host.offset("embed"), host.extent("head")[1])
        assert len(device.pinned) == 1
        assert torch.equal(host.h2d_source("layers.1"), loaded["layers.1"])
        start, end = host.extent("layers.1")
        assert _given_back(host.store.planes["lo"][start:end])
        assert host.store.planes["lo"][slice(*host.extent("layers.2"))].any()


def test_a_resident_unit_between_streamed_units_keeps_their_pinned_planes() -> None:
    """Units updated on the device as they stream also page-lock a split master's other planes, from the
    first streamed unit to the last: a resident unit between them keeps its pages in those spans too,
    after a drain wrote them and the next step's release."""
    streamed = ("layers.0", "layers.2")
    with _engine(("layers.1",), master_format="split", streamed=streamed) as (device, host, _, engine):
        _assert_one_span(device, host, host.offset("embed"), host.extent("head")[1])
        engine.step(toy_batches(_CFG, steps=1, accum=1, seed=5)[0], lr=1e-3)
        engine.drain()
        low_bits = host.store.planes["lo"][slice(*host.extent("layers.1"))]
        drained = low_bits.clone()
        assert drained[_PAGES].any()
        engine.step(toy_batches(_CFG, steps=1, accum=1, seed=6)[0], lr=1e-3)
        assert torch.equal(low_bits, drained), "pages under a streamed span were given back"


@pytest.mark.parametrize("rank", [0, 1])
def test_two_ranks_register_one_span_per_stretch_of_their_shards(rank: int) -> None:
    """Data parallel: a rank's shards of consecutive units have the other rank's between them, so each
    is its own span, never one span over the other rank's shards; the resident block between two of them
    lies beside the other rank's shards too, so it is not bridged and its pages are given back."""
    model = ToyModel(_CFG)
    with _engine(("layers.1",), group=_RankOfTwo(rank)) as (device, host, _, _):
        shards = []
        for unit in model.units:
            if unit.name != "layers.1":
                lo, hi = shard_span(unit.layout.numel, rank, 2)
                shards.append((host.offset(unit) + lo, host.offset(unit) + hi))
        assert len(shards) == 5
        _assert_spans(device, host, *shards)
        assert _given_back(host.flat("layers.1"))
        for unit in model.units:  # the other rank's shards are never page-locked
            lo, hi = shard_span(unit.layout.numel, 1 - rank, 2)
            other = host.h2d_span(host.offset(unit) + lo, host.offset(unit) + hi)
            assert outside(other, device.pinned) == [other], f"{unit.name}: the other rank's shard is locked"


def test_no_span_when_every_unit_is_resident() -> None:
    resident = ("embed", *(f"layers.{i}" for i in range(_CFG.num_layers)), "head")
    with _engine(resident) as (device, host, _, _):
        assert device.pinned == []
        assert all(_given_back(host.flat(name)) for name in resident)


def test_pinned_spans_join_contiguous_extents_and_gaps_that_resident_units_fill() -> None:
    # in any order; contiguous extents join, empty ones are dropped
    assert pinned_spans([(30, 40), (10, 20), (20, 30), (50, 50)], []) == [(10, 40)]
    assert pinned_spans([(10, 20), (30, 40)], []) == [(10, 20), (30, 40)]
    # a gap wholly inside the resident units' ranges, one or several touching ones, is bridged
    assert pinned_spans([(10, 20), (30, 40)], [(20, 30)]) == [(10, 40)]
    assert pinned_spans([(10, 20), (30, 40)], [(15, 25), (25, 35)]) == [(10, 40)]
    # a gap with anything else in it is not: one process's resident unit beside another rank's shard
    assert pinned_spans([(10, 20), (30, 40)], [(20, 29)]) == [(10, 20), (30, 40)]
    assert pinned_spans([(10, 20), (30, 40)], [(20, 25), (26, 30)]) == [(10, 20), (30, 40)]
    assert pinned_spans([(5, 5)], [(0, 10)]) == []
    assert pinned_spans([], []) == []


def test_a_resident_unit_between_two_stretches_of_a_rank_is_bridged_only_when_the_gap_is_resident() -> None:
    """Units a = [0, 100), resident r = [100, 150), b = [150, 250) under two ranks: rank 1's shard of a
    runs to r, but its shard of b starts after rank 0's, so nothing is bridged; a rank whose shard of b
    started at b (as rank 0's of a unit does) would be joined across r whole."""
    units = {"a": (0, 100), "b": (150, 250)}
    resident = [(100, 150)]

    def extents(rank: int) -> list[tuple[int, int]]:
        return [
            (start + lo, start + hi) for start, end in units.values() for lo, hi in [shard_span(end - start, rank, 2)]
        ]

    assert pinned_spans(extents(0), resident) == [(0, 50), (150, 200)]
    assert pinned_spans(extents(1), resident) == [(50, 100), (200, 250)]
    assert pinned_spans([(50, 100), (150, 200)], resident) == [(50, 200)]
    assert pinned_spans([(50, 100), (150, 200)], [(100, 140)]) == [(50, 100), (150, 200)]


def test_outside_cuts_the_kept_memory_out() -> None:
    plane = torch.arange(100, dtype=torch.float32)
    other = torch.zeros(100)

    def cut(tensor: torch.Tensor, *kept: torch.Tensor) -> list[list[float]]:
        return [part.tolist() for part in outside(tensor, kept)]

    assert cut(plane[10:20]) == [plane[10:20].tolist()]
    assert cut(plane[10:20], other[10:20]) == [plane[10:20].tolist()]  # another allocation
    assert cut(plane[10:20], plane[20:30]) == [plane[10:20].tolist()]  # next to it
    assert cut(plane[10:20], plane[5:25]) == []
    assert cut(plane[10:20], plane[12:15]) == [plane[10:12].tolist(), plane[15:20].tolist()]
    assert cut(plane[10:20], plane[15:40]) == [plane[10:15].tolist()]
    bytes_ = plane.view(torch.uint8)  # a kept range that ends inside an element keeps that element
    assert cut(plane[10:20], bytes_[40:62]) == [plane[16:20].tolist()]
    assert cut(plane[10:20], plane[12:13], plane[14:16], plane[18:30]) == [[10.0, 11.0], [13.0], [16.0, 17.0]]
