"""The summed gradients' pool of the GPU-streamed updates (slide_core/engine/sums_pool.py): one buffer per
summing unit that can be in flight, lent with a staging set and given back with it, on the CPU device with
the host placement's bits (Note [One sum per summing unit in flight])."""

from __future__ import annotations

import pytest
import torch
from test_streamed_pipeline import _assert_same_bits, _run

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.engine.sums_pool import SumsPool
from slide_core.engine.update_staging import STAGING_SETS, UpdateStaging
from slide_core.optim import TorchAdamW
from slide_core.optim.state_formats import state_arrays
from slide_core.testing import ToyConfig, ToyModel, load_init, toy_batches, toy_init

TIED = ToyConfig(tie_embeddings=True, num_layers=3)
EVERY_UNIT = ("embed", "layers.0", "layers.1", "layers.2", "head")


class _Event:
    """A stand-in for a device event: only its identity matters to the pool."""


def test_the_pool_holds_one_buffer_per_summing_unit_in_flight_of_the_largest() -> None:
    """Note [One sum per summing unit in flight]: ``min(summing units, sets)`` buffers, each the largest
    summing shard; what ``bytes_for`` prices is what ``hold`` allocates, once."""
    assert SumsPool.size_for([], 3) == (0, 0)
    assert SumsPool.size_for([500], 3) == (1, 500)  # a tied embedding alone
    assert SumsPool.size_for([500, 900, 900, 900, 10], 3) == (3, 900)  # accumulation: one per set
    assert SumsPool.size_for([500, 900], 3) == (2, 900)
    with CPUDevice() as device:
        pool = SumsPool(device, 3)
        pool.hold([])
        assert pool.buffers == []
        pool.hold([500])
        pool.hold([500])
        assert [held.values.numel() for held in pool.buffers] == [500]
        assert sum(h.values.numel() * h.values.element_size() for h in pool.buffers) == SumsPool.bytes_for([500], 3)
        pool.hold([400, 300, 200, 100])  # fit the buffer already held: two more of 400
        assert [held.values.numel() for held in pool.buffers] == [500, 400, 400]


def test_a_buffer_is_taken_as_given_back_and_carries_its_write_back() -> None:
    """The buffer taken is the free one given back longest ago that fits; it carries the event of the
    write-back that last read it, which the next upload into it waits for."""
    with CPUDevice() as device:
        pool = SumsPool(device, 3)
        pool.hold([100, 100])
        first = pool.take(100)
        second = pool.take(50)
        assert first is not second and first.free_after is None
        with pytest.raises(AssertionError, match="every summed-gradient buffer is held"):
            pool.take(1)
        written_second, written_first = _Event(), _Event()
        pool.give_back(second, written_second)
        pool.give_back(first, written_first)
        taken = pool.take(100)
        assert taken is second and taken.free_after is written_second


def test_a_staging_set_borrows_a_sum_only_for_a_summing_unit_and_gives_it_back_with_the_set() -> None:
    arrays = state_arrays("fp32")
    with CPUDevice() as device:
        staging = UpdateStaging(device, 1000, arrays, split=False)
        staging.hold_sums([600])
        plain = staging.take()
        summing = staging.take(600)
        assert plain.sums is None and summing.sums is not None
        lent = summing.sums
        written = _Event()
        staging.release(summing, written)
        assert summing.sums is None and lent.free_after is written
        staging.release(plain, _Event())
        assert staging.take(600).sums is lent
        held = sum(
            t.numel() * t.element_size() for s in staging.sets for t in (s.master, *s.state.values()) if t is not None
        )
        held += sum(h.values.numel() * h.values.element_size() for h in staging.sums.buffers)
        assert held == UpdateStaging.bytes_for(1000, arrays, split=False, summing_numels=[600])


def _pools(monkeypatch: pytest.MonkeyPatch) -> list[SumsPool]:
    """Every pool built from now on (one per engine run)."""
    pools: list[SumsPool] = []
    build = SumsPool.__init__

    def recording(pool: SumsPool, *args: object, **kwargs: object) -> None:
        build(pool, *args, **kwargs)
        pools.append(pool)

    monkeypatch.setattr(SumsPool, "__init__", recording)
    return pools


@pytest.mark.parametrize("accum", [1, 2])
def test_a_streamed_tied_embedding_holds_one_sum_and_accumulation_one_per_set(
    accum: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every unit of a tied model streamed: without accumulation the tied embedding is the one unit that
    sums, and the run allocates exactly one buffer, the embedding's size, not one per set; with
    accumulation every unit sums and the run holds one per set, the largest unit's size. Masters and
    moments are the host placement's bit for bit either way (fp32, CPU device)."""
    model = ToyModel(TIED)
    init = toy_init(model, seed=5)
    batches = toy_batches(TIED, steps=3, accum=accum, seed=9)
    adam = AdamWConfig(weight_decay=0.1)
    base = dict(compute_dtype=torch.float32, transfer_chunk_numel=1024)
    host = _run(model, init, batches, TorchAdamW(adam), EngineConfig(**base))
    pools = _pools(monkeypatch)
    streamed = _run(model, init, batches, TorchAdamW(adam), EngineConfig(**base, streamed_units=EVERY_UNIT))
    assert streamed[4] == set(EVERY_UNIT)
    _assert_same_bits(streamed, host)
    (pool,) = pools
    numel = {unit.name: unit.layout.numel for unit in model.units}
    sizes = [held.values.numel() for held in pool.buffers]
    if accum == 1:
        assert sizes == [numel["embed"]]
        assert numel["embed"] < max(numel.values())  # sized by the summing unit, not the largest
    else:
        assert sizes == [max(numel.values())] * STAGING_SETS


def test_a_streamable_tied_embedding_has_its_sum_before_it_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Re-placement at a step boundary]: the pool is sized for the streamable units that sum, on the
    device or not, so moving the tied embedding to the device allocates nothing; the bits stay the host's."""
    model = ToyModel(TIED)
    init = toy_init(model, seed=3)
    batches = toy_batches(TIED, steps=3, accum=1, seed=4)
    config = EngineConfig(
        compute_dtype=torch.float32, transfer_chunk_numel=1024, streamed_units=("layers.1",),
        streamable_units=("embed",),
    )  # fmt: skip
    pools = _pools(monkeypatch)
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, init)
        with Engine(model, device, host, TorchAdamW(AdamWConfig()), config) as engine:
            engine.step(batches[0], lr=1e-3)
            (pool,) = pools
            held = [h.values.data_ptr() for h in pool.buffers]
            assert len(held) == 1
            engine.place_streamed(("embed", "layers.1"))
            for micro in batches[1:]:
                engine.step(micro, lr=1e-3)
            engine.wait_idle()
            assert [h.values.data_ptr() for h in pool.buffers] == held
            assert all(staged.sums is None for staged in engine.pipelines.streamed.staging.sets)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("accum", [1, 3])
def test_on_a_gpu_pooled_sums_track_the_host_run(accum: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA streams a summed-gradient buffer serves whichever set its unit takes, its upload waiting for
    the write-back that last read it (Note [One sum per summing unit in flight]): a tied model with every
    unit streamed keeps the all-host run's losses over several steps (not bits: CUDA's atomic sums differ
    run to run, tests/core/test_streamed_gpu.py), with one buffer, or one per set with accumulation."""
    from slide_core.devices.cuda import CUDADevice
    from slide_core.optim import build_optimizer

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ToyConfig(tie_embeddings=True, num_layers=4, hidden_size=128, intermediate_size=344, vocab_size=512)
    model = ToyModel(cfg)
    init = toy_init(model, seed=5)
    batches = toy_batches(cfg, steps=6, accum=accum, seed=9, batch=4, seq=64)
    adam = AdamWConfig(weight_decay=0.1, state_format="bf16")
    pools = _pools(monkeypatch)

    def run(streamed: tuple[str, ...]) -> list[float]:
        config = EngineConfig(compute_dtype=torch.bfloat16, transfer_chunk_numel=8192, streamed_units=streamed)
        with CUDADevice() as device:
            host = HostParameters(model, master_format="split")
            load_init(host, init)
            with Engine(model, device, host, build_optimizer("auto", adam), config) as engine:
                losses = [engine.step(micro, lr=3e-3).loss for micro in batches]
                engine.wait_idle()
        return losses

    host = run(())
    streamed = run(("embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"))
    assert streamed == pytest.approx(host, rel=1e-3)
    assert streamed[-1] < streamed[0]
    counts = [len(pool.buffers) for pool in pools]
    assert counts == [0, 1 if accum == 1 else STAGING_SETS]
