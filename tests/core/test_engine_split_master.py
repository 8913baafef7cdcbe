"""The engine with a split master against the same engine with an fp32 master, on the CPU device in bf16.

A split master (slide_core/split_master.py) holds the same fp32 values, so every run must be bit-identical
to the fp32 master's: the losses, the final masters and the Adam state, through accumulation, clipping, a
tied embedding, device-resident and tier-offloaded units, and checkpoints that resume in the other format.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.checkpoint import save_checkpoint
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig, choose_master_format
from slide_core.optim import TorchAdamW
from slide_core.optim.fused_adamw import FusedAdamW
from slide_core.optimizer import Optimizer
from slide_core.testing import ToyConfig, ToyModel, load_init, toy_batches, toy_init
from slide_core.tiers.host_ram import HostRamTier

ADAM = AdamWConfig(weight_decay=0.1)
CFG = ToyConfig(tie_embeddings=True, num_layers=4, vocab_size=1024, hidden_size=64)

SCENARIOS = {
    "accumulation": ({"transfer_chunk_numel": 1024}, 2),
    "clipping": ({"transfer_chunk_numel": 1024, "max_grad_norm": 0.05}, 2),
    "clipping-one-micro-batch": ({"transfer_chunk_numel": 4096, "max_grad_norm": 0.05}, 1),
    "resident-and-offloaded": (
        {"transfer_chunk_numel": 1024, "resident_units": ("embed",), "offloaded_units": ("layers.1",)},
        2,
    ),
}


def _optimizer(kind: str) -> Optimizer:
    if kind == "numba":
        pytest.importorskip("numba")
        return FusedAdamW(ADAM)
    return TorchAdamW(ADAM, fused=kind == "torch-fused")


def _masters(host: HostParameters) -> dict[str, torch.Tensor]:
    return {unit.name: host.read(unit).clone() for unit in host.model.units}


def _run(
    master_format: str,
    kind: str,
    config: EngineConfig,
    batches,
    *,
    init_seed: int = 5,
    save_to: Path | None = None,
    restore: Path | None = None,
    pinned: bool = True,
):
    """Losses, final masters and Adam state of a run (optionally saving its checkpoint at the end, or
    starting from one)."""
    model = ToyModel(CFG)
    with CPUDevice() as device, HostRamTier() as tier:
        if pinned:
            host = HostParameters(model, device.alloc_pinned, master_format=master_format)
        else:
            host = HostParameters(model, master_format=master_format)  # as `slide train` allocates it
        load_init(host, toy_init(model, seed=init_seed))
        with Engine(model, device, host, _optimizer(kind), config, state_tier=tier) as engine:
            if restore is not None:
                engine.restore_schedule_state(engine.restore_checkpoint(restore)["extra"])
            losses = [engine.step(micro, lr=3e-3).loss for micro in batches]
            saved = None
            if save_to is not None:  # with the schedule state: clipping's deferral rounds differently
                saved = save_checkpoint(save_to, engine.step_count, engine.checkpoint_arrays(), engine.schedule_state())
            engine.drain(with_state=True)
            state = {name: slab.clone() for name, slab in engine.host_state.state_slabs.items()}
        return losses, _masters(host), state, host, saved


def _assert_same(got, want) -> None:
    assert got[0] == want[0], "losses differ"
    for name, master in want[1].items():
        assert torch.equal(got[1][name].view(torch.int32), master.view(torch.int32)), f"master of {name} differs"
    for name, slab in want[2].items():
        assert torch.equal(got[2][name], slab), f"{name} differs"


@pytest.mark.parametrize("kind", ["numba", "torch", "torch-fused"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_split_master_trains_bit_identically(kind: str, scenario: str) -> None:
    settings, accum = SCENARIOS[scenario]
    config = EngineConfig(compute_dtype=torch.bfloat16, **settings)
    batches = toy_batches(CFG, steps=4, accum=accum, seed=3)
    fp32 = _run("fp32", kind, config, batches)
    split = _run("split", kind, config, batches)
    _assert_same(split, fp32)
    host = split[3]
    for unit in host.model.units:  # the plane the h2d sends is the device's own cast of the master
        assert torch.equal(host.h2d_source(unit), fp32[1][unit.name].to(torch.bfloat16)), unit.name


def test_an_unpinned_split_master_gives_resident_pages_back_and_trains_the_same() -> None:
    """As `slide train` allocates it: the engine pins the streamed bf16 ranges and gives back the
    resident unit's planes (Note [Resident host copies]); a drain brings them back, decoded exactly."""
    config = EngineConfig(compute_dtype=torch.bfloat16, transfer_chunk_numel=1024, resident_units=("embed",))
    batches = toy_batches(CFG, steps=3, accum=1, seed=4)
    fp32 = _run("fp32", "torch", config, batches, pinned=False)
    split = _run("split", "torch", config, batches, pinned=False)
    _assert_same(split, fp32)


@pytest.mark.parametrize(("first", "then"), [("split", "fp32"), ("fp32", "split")])
def test_checkpoints_resume_across_master_formats(tmp_path: Path, first: str, then: str) -> None:
    """A checkpoint stores the fp32 master whatever the format, so a run resumes in the other one and
    continues bit for bit."""
    config = EngineConfig(
        compute_dtype=torch.bfloat16, transfer_chunk_numel=1024, max_grad_norm=0.05, resident_units=("layers.2",)
    )
    batches = toy_batches(CFG, steps=4, accum=2, seed=8)
    straight = _run(then, "numba", config, batches)
    saved = _run(first, "numba", config, batches[:2], save_to=tmp_path)[4]
    resumed = _run(then, "numba", config, batches[2:], init_seed=11, restore=saved)
    assert resumed[0] == straight[0][2:]
    _assert_same(("same", *resumed[1:]), ("same", *straight[1:]))


def test_host_parameters_read_write_and_edit_in_both_formats() -> None:
    model = ToyModel(CFG)
    init = toy_init(model, seed=2)
    fp32 = HostParameters(model)
    load_init(fp32, init)
    split = HostParameters(model, master_format="split")
    split.copy_from(fp32)
    assert split.nbytes == fp32.numel * 4 + fp32.numel // 8
    for unit in model.units:
        assert torch.equal(split.read(unit), fp32.flat(unit))
        assert torch.equal(split.read(unit, 70, 333), fp32.flat(unit)[70:333])
        for name, view in split.read_views(unit).items():
            assert torch.equal(view, init[unit.name][name])
    embed = model.embedding
    with split.editing(embed) as views:
        views["weight"][3].fill_(0.125)
    assert torch.equal(split.read_views(embed)["weight"][3], torch.full((CFG.hidden_size,), 0.125))
    split.write(embed, torch.full((5,), -2.5), start=64)
    assert torch.equal(split.read(embed, 64, 69), torch.full((5,), -2.5))
    fp32.write(embed, split.read(embed))
    walked = split.unit_views()  # decoded one unit at a time, in unit order
    assert list(walked) == [unit.name for unit in model.units]
    for unit in model.units:
        for name, view in fp32.views(unit).items():
            assert torch.equal(walked[unit.name][name], view), (unit.name, name)
    with pytest.raises(ValueError, match="this master is split; use read, write or editing"):
        split.views(embed)
    with pytest.raises(ValueError, match="this master is split"):
        _ = split.slab
    with pytest.raises(ValueError, match="master format must be fp32 or split"):
        HostParameters(model, master_format="bf16")


def test_the_split_master_is_refused_where_it_cannot_run() -> None:
    model = ToyModel(CFG)
    with pytest.raises(ValueError, match="needs compute_dtype bfloat16"):
        EngineConfig(compute_dtype=torch.float32, master_format="split")
    with pytest.raises(ValueError, match="master_format must be auto, fp32 or split"):
        EngineConfig(master_format="half")
    assert choose_master_format("auto", torch.bfloat16, TorchAdamW(ADAM)) == "split"
    assert choose_master_format("auto", torch.float32, TorchAdamW(ADAM)) == "fp32"
    assert choose_master_format("fp32", torch.bfloat16, TorchAdamW(ADAM)) == "fp32"
    # auto splits for what a link saves: the CPU device keeps one fp32 slab; asked for, split runs there
    assert choose_master_format("auto", torch.bfloat16, TorchAdamW(ADAM), accelerator=False) == "fp32"
    assert choose_master_format("split", torch.bfloat16, TorchAdamW(ADAM), accelerator=False) == "split"
    with pytest.raises(ValueError, match="the compute dtype is float32"):
        choose_master_format("split", torch.float32, TorchAdamW(ADAM))

    class Plain(TorchAdamW):
        split_master = False

    assert choose_master_format("auto", torch.bfloat16, Plain(ADAM)) == "fp32"
    with pytest.raises(ValueError, match="Plain cannot step it"):
        choose_master_format("split", torch.bfloat16, Plain(ADAM))
    with CPUDevice() as device:
        split = HostParameters(model, master_format="split")
        with pytest.raises(ValueError, match="compute dtype is float32"):
            Engine(model, device, split, TorchAdamW(ADAM), EngineConfig(compute_dtype=torch.float32))
        with pytest.raises(ValueError, match="Plain cannot step it"):
            Engine(model, device, split, Plain(ADAM), EngineConfig())
        with pytest.raises(ValueError, match="holds a split master"):
            Engine(model, device, split, TorchAdamW(ADAM), EngineConfig(master_format="fp32"))
