"""The engine against a plain PyTorch loop with torch.optim.AdamW, on the CPU device in fp32."""

from __future__ import annotations

import math

import pytest
import torch

from slide_core import AdamWConfig, HostParameters, LRSchedule
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.testing import ToyConfig, ToyModel, load_init, reference_loss, toy_batches, toy_init

RTOL = 1e-5


def _reference_lambda(kind: str, warmup: int, total: int):
    """Written independently of slide_core.schedule, from transformers' scheduler formulas."""

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, (total - step) / max(1, total - warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return factor


def _reference_run(model, init, batches, adam: AdamWConfig, schedule: LRSchedule):
    params = {unit: {name: torch.nn.Parameter(t.clone()) for name, t in views.items()} for unit, views in init.items()}
    flat = [p for views in params.values() for p in views.values()]
    decay = [p for p in flat if p.dim() >= 2]
    no_decay = [p for p in flat if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": adam.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=schedule.base_lr,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _reference_lambda(schedule.kind, schedule.warmup_steps, schedule.total_steps)
    )
    losses = []
    for micro in batches:
        tokens = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
        total = 0.0
        for ids, labels in micro:
            loss = reference_loss(model, params, ids, labels)
            (loss / tokens).backward()
            total += loss.item()
        losses.append(total / tokens)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return losses, params


def _engine_run(model, init, batches, adam, schedule, engine_config):
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, init)
        losses = []
        with Engine(model, device, host, TorchAdamW(adam), engine_config) as engine:
            for step, micro in enumerate(batches):
                losses.append(engine.step(micro, lr=schedule.lr_at(step)).loss)
        return losses, {unit.name: host.views(unit) for unit in model.units}


def _assert_close(engine_result, reference_result):
    losses, params = engine_result
    ref_losses, ref_params = reference_result
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert got == pytest.approx(want, rel=RTOL), f"loss differs at step {step + 1}"
    for unit, views in ref_params.items():
        for name, want in views.items():
            got = params[unit][name]
            err = (got - want.detach()).norm() / want.detach().norm()
            assert err <= RTOL, f"{unit}.{name} differs: relative error {err:.2e}"


@pytest.mark.parametrize("block_slots", [1, 2, 3])
@pytest.mark.parametrize("tied", [False, True])
def test_engine_matches_plain_adamw(block_slots: int, tied: bool) -> None:
    cfg = ToyConfig(tie_embeddings=tied, num_layers=4)
    model = ToyModel(cfg)
    init = toy_init(model)
    batches = toy_batches(cfg, steps=4, accum=1)
    adam = AdamWConfig(weight_decay=0.1)
    schedule = LRSchedule(3e-3, "constant")
    config = EngineConfig(block_slots=block_slots, compute_dtype=torch.float32, transfer_chunk_numel=2048)
    _assert_close(
        _engine_run(model, init, batches, adam, schedule, config),
        _reference_run(model, init, batches, adam, schedule),
    )


@pytest.mark.parametrize("accum", [1, 2])
def test_a_ring_of_one_chunk_neither_deadlocks_nor_changes_the_math(accum: int) -> None:
    """Note [Only landed chunks are queued]: the d2h thread hands each ring chunk to the optimizer before
    it takes the next one, so a unit of many chunks streams through a single ring chunk."""
    cfg = ToyConfig(tie_embeddings=True, num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=7)
    batches = toy_batches(cfg, steps=3, accum=accum, seed=2)
    adam = AdamWConfig(weight_decay=0.1)
    schedule = LRSchedule(3e-3, "constant")
    config = EngineConfig(
        compute_dtype=torch.float32,
        transfer_chunk_numel=1024,
        grad_ring_slots=1,
        grad_ring_fraction=0.0,
        timeout_s=20.0,
    )
    _assert_close(
        _engine_run(model, init, batches, adam, schedule, config),
        _reference_run(model, init, batches, adam, schedule),
    )


@pytest.mark.parametrize("tied", [False, True])
def test_gradient_accumulation_matches(tied: bool) -> None:
    cfg = ToyConfig(tie_embeddings=tied)
    model = ToyModel(cfg)
    init = toy_init(model, seed=3)
    batches = toy_batches(cfg, steps=3, accum=3, seed=5)
    adam = AdamWConfig(beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.05)
    schedule = LRSchedule(2e-3, "constant")
    config = EngineConfig(block_slots=2, compute_dtype=torch.float32, transfer_chunk_numel=1024, grad_ring_slots=2)
    _assert_close(
        _engine_run(model, init, batches, adam, schedule, config),
        _reference_run(model, init, batches, adam, schedule),
    )


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("resident", [("embed",), ("head", "layers.0", "layers.2"), ("embed", "layers.1", "head")])
def test_device_resident_units_match(tied: bool, resident: tuple[str, ...], accum: int) -> None:
    """Covers Note [Tied gradient in the slot] (tied, accum 1) and the fp32 accumulator (accum 2)."""
    cfg = ToyConfig(tie_embeddings=tied, num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=13)
    batches = toy_batches(cfg, steps=3, accum=accum, seed=4)
    adam = AdamWConfig(weight_decay=0.1)
    schedule = LRSchedule(3e-3, "constant")
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, resident_units=resident)
    _assert_close(
        _engine_run(model, init, batches, adam, schedule, config),
        _reference_run(model, init, batches, adam, schedule),
    )


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_lr_schedules_match(kind: str) -> None:
    cfg = ToyConfig(num_layers=2)
    model = ToyModel(cfg)
    init = toy_init(model, seed=7)
    batches = toy_batches(cfg, steps=6, accum=1, seed=9)
    adam = AdamWConfig(weight_decay=0.01)
    schedule = LRSchedule(5e-3, kind, warmup_steps=2, total_steps=6)
    config = EngineConfig(block_slots=2, compute_dtype=torch.float32)
    _assert_close(
        _engine_run(model, init, batches, adam, schedule, config),
        _reference_run(model, init, batches, adam, schedule),
    )


@pytest.mark.parametrize("clip", [0.0, 0.05])
@pytest.mark.parametrize("accum", [1, 2])
def test_nvme_state_is_bit_identical_to_ram(accum: int, clip: float) -> None:
    """Adam state of offloaded units on a tier gives the same bits as keeping it in RAM.

    Cites Note [Staging reuse ordering] in state_offload.py: three offloaded units share two staging sets,
    so sets are evicted, written back and read again within every step.
    """
    from slide_core.tiers.host_ram import HostRamTier

    cfg = ToyConfig(tie_embeddings=True, num_layers=4)
    model = ToyModel(cfg)
    init = toy_init(model, seed=21)
    batches = toy_batches(cfg, steps=3, accum=accum, seed=8)
    adam = AdamWConfig(weight_decay=0.1)
    base = dict(compute_dtype=torch.float32, transfer_chunk_numel=1024, max_grad_norm=clip)

    def run(config: EngineConfig, tier=None):
        with CPUDevice() as device:
            host = HostParameters(model, device.alloc_pinned)
            load_init(host, init)
            with Engine(model, device, host, TorchAdamW(adam), config, state_tier=tier) as engine:
                losses = [engine.step(micro, lr=3e-3).loss for micro in batches]
                engine.drain(with_state=True)
                state = {u.name: {k: v.clone() for k, v in engine.host_state.views(u).items()} for u in model.units}
            return losses, host.slab.clone(), state

    ram = run(EngineConfig(**base))
    with HostRamTier() as tier:
        offloaded = ("layers.0", "layers.2", "layers.3", "embed")
        nvme = run(EngineConfig(**base, offloaded_units=offloaded), tier)
    assert nvme[0] == ram[0]
    assert torch.equal(nvme[1], ram[1])
    for unit, views in ram[2].items():
        for name, tensor in views.items():
            assert torch.equal(nvme[2][unit][name], tensor), (unit, name)


@pytest.mark.parametrize("accum", [1, 2])
def test_activations_on_a_tier_are_bit_identical(accum: int) -> None:
    """Block inputs through a tier, staged (Note [Activation staging ordering]) or handed over as they are
    (Note [Direct activation I/O]), give the same bits as RAM."""
    from slide_core.tiers.host_ram import HostRamTier

    cfg = ToyConfig(num_layers=5)
    model = ToyModel(cfg)
    init = toy_init(model, seed=17)
    batches = toy_batches(cfg, steps=3, accum=accum, seed=2)
    adam = AdamWConfig(weight_decay=0.1)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024)

    def run(tier=None):
        with CPUDevice() as device:
            host = HostParameters(model, device.alloc_pinned)
            load_init(host, init)
            with Engine(model, device, host, TorchAdamW(adam), config, activation_tier=tier) as engine:
                losses = [engine.step(micro, lr=3e-3).loss for micro in batches]
            return losses, host.slab.clone()

    class DirectTier(HostRamTier):
        """Takes the block inputs themselves, as GPUDirect Storage would (Note [Direct activation I/O])."""

        moves_device_memory = True

        def __init__(self) -> None:
            super().__init__()
            self.put_sources: list[int] = []

        def put(self, key, tensor):
            self.put_sources.append(tensor.data_ptr())
            return super().put(key, tensor)

    ram = run()
    with HostRamTier() as tier:
        stashed = run(tier)
    assert stashed[0] == ram[0]
    assert torch.equal(stashed[1], ram[1])
    with DirectTier() as direct:
        unstaged = run(direct)
    assert unstaged[0] == ram[0]
    assert torch.equal(unstaged[1], ram[1])
    assert len(direct.put_sources) == 3 * accum * cfg.num_layers  # every block input, every step


def test_checkpoint_arrays_read_state_where_it_lives(tmp_path) -> None:
    """A save through ``checkpoint_arrays`` writes the same files as one from gathered host slabs, and
    leaves the host copies of device-resident units' masters and of device-resident and offloaded units'
    Adam state untouched (on an unpinned slab the resident pages stay given back)."""
    from slide_core.checkpoint import load_checkpoint, save_checkpoint
    from slide_core.tiers.host_ram import HostRamTier

    cfg = ToyConfig(tie_embeddings=True, num_layers=4, vocab_size=4096, hidden_size=64)  # a 1 MiB embedding
    model = ToyModel(cfg)
    init = toy_init(model, seed=23)
    batches = toy_batches(cfg, steps=2, accum=1, seed=4)
    config = EngineConfig(
        compute_dtype=torch.float32,
        transfer_chunk_numel=1024,
        resident_units=("embed", "layers.1"),
        offloaded_units=("layers.0", "layers.3"),
    )
    with CPUDevice() as device, HostRamTier() as tier:
        host = HostParameters(model)  # unpinned, as `slide train` allocates it
        load_init(host, init)
        with Engine(model, device, host, TorchAdamW(AdamWConfig(weight_decay=0.1)), config, state_tier=tier) as engine:
            for micro in batches:
                engine.step(micro, lr=3e-3)
            streamed = save_checkpoint(tmp_path, 1, engine.checkpoint_arrays(), {})
            elsewhere = ("embed", "layers.1", "layers.0", "layers.3")
            assert not any(engine.host_state.valid[name] for name in elsewhere)
            assert not host.flat("embed")[4096:-4096].any(), "the resident master came back to the host"
            engine.drain(with_state=True)
            assert host.flat("embed")[4096:-4096].any()  # a drain does bring it back
            gathered = {"master": host.slab.clone(), **{k: v.clone() for k, v in engine.host_state.state_slabs.items()}}
    loaded = {name: torch.empty_like(tensor) for name, tensor in gathered.items()}
    load_checkpoint(streamed, loaded)
    for name, tensor in gathered.items():
        assert torch.equal(loaded[name], tensor), name
    assert loaded["exp_avg"].abs().sum() > 0  # real moments, not the zeros of never-written host pages


@pytest.mark.parametrize("streamed", [(), ("layers.2", "head")])
def test_restore_checkpoint_streams_to_where_units_live(tmp_path, streamed: tuple[str, ...]) -> None:
    """``Engine.restore_checkpoint`` writes each unit's master and Adam state where the unit lives (the
    device, the state tier, the host slabs, from which streamed units are updated on the device) without
    bringing resident masters back to the host, and the resumed run continues bit for bit."""
    from slide_core.checkpoint import save_checkpoint
    from slide_core.tiers.host_ram import HostRamTier

    cfg = ToyConfig(tie_embeddings=True, num_layers=4, vocab_size=4096, hidden_size=64)  # a 1 MiB embedding
    model = ToyModel(cfg)
    batches = toy_batches(cfg, steps=4, accum=1, seed=6)
    config = EngineConfig(
        compute_dtype=torch.float32,
        transfer_chunk_numel=1024,
        resident_units=("embed", "layers.1"),
        offloaded_units=("layers.0", "layers.3"),
        streamed_units=streamed,
    )
    elsewhere = ("embed", "layers.1", "layers.0", "layers.3")

    def run(steps, init_seed: int, *, save: bool = False, restore=None):
        with CPUDevice() as device, HostRamTier() as tier:
            host = HostParameters(model)  # unpinned, as `slide train` allocates it
            load_init(host, toy_init(model, seed=init_seed))
            with Engine(model, device, host, TorchAdamW(AdamWConfig(weight_decay=0.1)), config, state_tier=tier) as e:
                if restore is not None:
                    e.restore_schedule_state({"step": e.restore_checkpoint(restore)["step"]})
                    assert not host.flat("embed")[4096:-4096].any(), "the resident master came to the host"
                    assert not any(e.host_state.valid[name] for name in elsewhere)
                losses = [e.step(micro, lr=3e-3).loss for micro in steps]
                saved = save_checkpoint(tmp_path, e.step_count, e.checkpoint_arrays(), {}) if save else None
                e.drain(with_state=True)
                final = {"master": host.slab.clone(), **{k: v.clone() for k, v in e.host_state.state_slabs.items()}}
            return losses, final, saved

    full_losses, full_final, _ = run(batches, init_seed=29)
    _, _, saved = run(batches[:2], init_seed=29, save=True)
    resumed_losses, resumed_final, _ = run(batches[2:], init_seed=31, restore=saved)  # other weights, overwritten
    assert resumed_losses == full_losses[2:]
    for name, tensor in full_final.items():
        assert torch.equal(resumed_final[name], tensor), name


def test_resident_host_copies_are_released() -> None:
    """Note [Resident host copies]: with an unpinned slab, a resident unit's host range is given back
    after the engine copies it to the device, refreshed by a drain (not by ``wait_idle``), given back
    again at the next step;
    ``close(keep_host_state=False)`` frees the host Adam state and still leaves current masters."""
    cfg = ToyConfig(vocab_size=4096, hidden_size=64, num_layers=2)  # a 1 MiB embedding: many whole pages
    model = ToyModel(cfg)
    init = toy_init(model, seed=3)
    batches = toy_batches(cfg, steps=3, accum=1, seed=5)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=4096, resident_units=("embed",))
    with CPUDevice() as device:
        host = HostParameters(model)  # unpinned: the engine pins what it copies from and releases the rest
        load_init(host, init)
        inside = slice(4096, -4096)  # whole pages, whatever the slab's alignment
        with Engine(model, device, host, TorchAdamW(AdamWConfig()), config) as engine:
            device_master = engine.residents.units["embed"].master
            expected = torch.cat([init["embed"][spec.name].reshape(-1) for spec in model.embedding.layout])
            assert torch.equal(device_master[: expected.numel()], expected)  # copied before the release
            assert not host.flat("embed")[inside].any(), "the resident range was not given back"
            engine.step(batches[0], lr=1e-3)
            engine.drain()
            assert torch.equal(host.flat("embed"), device_master)
            engine.step(batches[1], lr=1e-3)
            assert not host.flat("embed")[inside].any()
            engine.wait_idle()  # the whole step is applied, nothing comes back to the host
            assert all(future.done() for future in engine.updated.values())
            assert not host.flat("embed")[inside].any()
            engine.step(batches[2], lr=1e-3)
            engine.close(keep_host_state=False)
            assert all(slab.numel() == 0 for slab in engine.host_state.state_slabs.values())
            assert torch.equal(host.flat("embed"), device_master)


def test_release_pages_gives_memory_back() -> None:
    import psutil

    from slide_core.host_memory import release_pages

    process = psutil.Process()
    tensor = torch.ones(16 << 20)  # 64 MiB, touched
    before = process.memory_info().rss
    released = release_pages(tensor)
    after = process.memory_info().rss
    assert released >= (64 << 20) - 8192
    assert before - after >= released // 2  # the kernel dropped them (allow for other allocations)
    assert not tensor[2048:-2048].any()  # zero-filled when read again
