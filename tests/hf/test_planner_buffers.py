"""The plan's engine buffers equal what a real engine allocates, buffer by buffer, on the CPU.

Every allocation slide-core makes while a run is built and steps is recorded (``torch.empty``/``zeros``/
``ones``/``full`` and their ``_like`` forms, ``numpy.empty``/``zeros``, and the device's ``empty`` and
``alloc_pinned``), together with the object that made it; an allocation still alive after two steps is a
buffer. Each live buffer is named by its owner (the class of the first slide-core frame with a ``self``)
and by where it lives (the device, when it came from ``Device.empty`` or from the resident units' update;
the host otherwise), and the plan (:func:`slide_hf.planner.memory.engine_buffers`) must price every name
to the byte. A buffer with no name in the plan fails the test: that is how the compact state's update
temporaries once escaped every plan.

On the CPU device the "device" and the host are one memory, so the owner decides which side of the plan a
buffer belongs to. Ranges the engine allocates but never touches (the host master and optimizer state of
units kept elsewhere) cost no memory: the plan prices what is touched, so those ranges, measured on the
engine's own tensors, are taken off; a resident unit's master inside the span the engine page-locks is
kept (Note [One registration per allocation]), so the plan prices it and it stays.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import threading
import weakref
from typing import Any

import numpy as np
import pytest
import torch

import slide_core
from slide_core import AdamWConfig, HostParameters
from slide_core.allocation_ledger import HostAllocations
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.engine.host_span import outside
from slide_core.engine.update_staging import UpdateStaging
from slide_core.optim import TorchAdamW
from slide_core.optim.compact_adamw import CompactAdamW
from slide_core.optim.fused_adamw import FusedAdamW
from slide_core.optimizer import Optimizer
from slide_core.testing import ToyConfig, ToyModel, load_init, toy_init
from slide_core.tiers.host_ram import HostRamTier
from slide_hf.planner import PlanInputs, make_plan
from slide_hf.planner.memory import ENGINE_DEVICE_BUFFERS, ENGINE_HOST_BUFFERS, engine_buffers

_CORE = os.path.dirname(slide_core.__file__)
_DEVICE_MODULES = (os.path.join(_CORE, "device.py"), os.path.join(_CORE, "devices"))
_RESIDENT_UPDATE = ("ResidentPipeline", "ResidentUnits", "ScaledGrads")
"""Owners whose allocations are the device's: the resident units and their update (its optimizer replica
allocates through plain torch calls, which on the CPU device look like the host's)."""
_STREAMED_UPDATE = ("StreamedPipeline", "UpdateStaging")
"""Owners whose allocations are the GPU-streamed updates' (their staging sets, and the optimizer replica's
scratch when it steps a staged unit): the plan's ``streamed_staging``."""
_HOST_OWNERS = ("HostState",)
"""Owners whose allocations are the host's whoever asks for them: a streamed unit's fp32 host accumulator,
which the streamed update's upload reads (Note [Streamed accumulation])."""

_TORCH_ALLOCATORS = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like")
_NUMPY_ALLOCATORS = ("empty", "zeros")


@dataclasses.dataclass(frozen=True)
class _Site:
    side: str  # "host" or "device"
    owner: str  # class name of the allocating object
    function: str
    streamed: bool = False  # allocated on behalf of a GPU-streamed update


class _AllocationLog:
    """Live bytes by allocation site, for allocations slide-core makes (see the module docstring)."""

    def __init__(self) -> None:
        self.live: collections.Counter[_Site] = collections.Counter()
        self._lock = threading.RLock()  # threads allocate; a finalizer may run inside ``record``
        self._calls = threading.local()  # .side: set while a device method allocates, per thread

    def _site(self) -> _Site | None:
        frame = sys._getframe(2)
        owner = function = None
        resident = streamed = False
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(_CORE) and not path.startswith(_DEVICE_MODULES):
                this = frame.f_locals.get("self")
                if this is not None:
                    name = type(this).__name__
                    if owner is None:
                        owner, function = name, frame.f_code.co_name
                    resident = resident or name in _RESIDENT_UPDATE
                    streamed = streamed or name in _STREAMED_UPDATE
            frame = frame.f_back
        if owner is None:
            return None
        on_device = (resident or streamed) and owner not in _HOST_OWNERS
        side = getattr(self._calls, "side", None) or ("device" if on_device else "host")
        return _Site(side, owner, function or "", streamed and side == "device")

    def record(self, value: Any) -> None:
        site = self._site()
        if site is None:
            return
        target = value.untyped_storage() if isinstance(value, torch.Tensor) else value
        nbytes = target.nbytes() if isinstance(value, torch.Tensor) else value.nbytes
        with self._lock:
            self.live[site] += nbytes
        weakref.finalize(target, self._freed, site, nbytes)

    def _freed(self, site: _Site, nbytes: int) -> None:
        with self._lock:
            self.live[site] -= nbytes

    def device_call(self, side: str, method: Any, *args: Any) -> torch.Tensor:
        self._calls.side = side
        try:
            return method(*args)
        finally:
            self._calls.side = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Start recording. Numba compiles a kernel with the numpy it finds then, so the optimizer's
        kernels are compiled (``warmup``) before."""

        def wrap(allocate: Any) -> Any:
            def allocating(*args: Any, **kwargs: Any) -> Any:
                value = allocate(*args, **kwargs)
                self.record(value)
                return value

            return allocating

        for name in _TORCH_ALLOCATORS:
            monkeypatch.setattr(torch, name, wrap(getattr(torch, name)))
        for name in _NUMPY_ALLOCATORS:
            monkeypatch.setattr(np, name, wrap(getattr(np, name)))
        empty, pinned = CPUDevice.empty, CPUDevice.alloc_pinned
        monkeypatch.setattr(CPUDevice, "empty", lambda device, *a: self.device_call("device", empty, device, *a))
        monkeypatch.setattr(CPUDevice, "alloc_pinned", lambda device, *a: self.device_call("host", pinned, device, *a))


def _buffer(site: _Site) -> str:
    """The plan's name for a live allocation: ``side/key`` (``disk`` for what a tier stores)."""
    owner, function = site.owner, site.function
    if owner == "HostRamTier":
        return "disk"
    if site.streamed:
        return "device/streamed_staging"
    if site.side == "device":
        table = {
            "SlotWindow": "slots",
            "ResidentUnits": "resident_units",
            "MasterUpload": "h2d_staging",
            "ActivationStash": "activation_buffers",
            "TierActivationStash": "activation_buffers",
            "UnitNorms": "grad_norms",
        }
        key = table.get(owner, "resident_scratch")  # the resident update's own and its optimizer's scratch
        return f"device/{key}"
    table = {
        "HostParameters": "master_fp32",
        "Fp32MasterStore": "master_fp32",  # the master store allocates the planes HostParameters holds
        "SplitMasterStore": "master_fp32",
        "HostState": "grad_accumulators" if function == "accumulator" else "optimizer_state",
        "GradRing": "grad_ring",
        "GradStore": "grad_ring",
        "ActivationStash": "activation_stash",
        "TierActivationStash": "nvme_staging",
        "OffloadedState": "nvme_staging",
        "UnitNorms": "grad_norms",
    }
    return f"host/{table.get(owner, 'optimizer_scratch' if _is_optimizer_part(owner) else owner)}"


def _is_optimizer_part(owner: str) -> bool:
    return owner in {cls.__name__ for cls in (TorchAdamW, CompactAdamW, FusedAdamW)} or owner == "AdamWCorrection"


@dataclasses.dataclass(frozen=True)
class _Case:
    id: str
    compute_dtype: torch.dtype = torch.float32
    optimizer_state: str = "fp32"
    fused: bool = False  # the numba kernels (FusedAdamW, or CompactAdamW's)
    master_format: str = "fp32"
    clipping: bool = False
    grad_accum: int = 1
    tied: bool = False
    resident: tuple[str, ...] = ()  # planner names: embedding, block.<i>, head
    streamed: tuple[str, ...] = ()  # planner names of the GPU-streamed units
    state_on_tier: float = 0.0  # nvme_fraction with --offload-optimizer nvme
    activations_on_tier: bool = False
    pinned_master: bool = False


_CASES = [
    _Case("fp32"),
    _Case("bf16-state-tied-accum-clip", torch.bfloat16, "bf16", tied=True, grad_accum=2, clipping=True),
    _Case(
        "int8-split-clip-resident",
        torch.bfloat16,
        "int8",
        master_format="split",
        clipping=True,
        resident=("embedding",),
    ),
    _Case("fp32-resident-blocks-accum-clip", resident=("block.1", "head"), grad_accum=2, clipping=True),
    _Case("split-resident-inside-the-span", torch.bfloat16, master_format="split", resident=("block.1",)),
    _Case("fp32-resident-at-an-end-and-inside", resident=("embedding", "block.1")),
    _Case("split-ring-pinned", torch.bfloat16, master_format="split", tied=True, pinned_master=True),
    _Case("fused-split-clip", torch.bfloat16, fused=True, master_format="split", clipping=True, tied=True),
    _Case("int8-fused-accum", torch.bfloat16, "int8", fused=True, grad_accum=2),
    _Case("tiers", torch.bfloat16, "bf16", state_on_tier=0.5, activations_on_tier=True, clipping=True),
    _Case("streamed-split-bf16", torch.bfloat16, "bf16", master_format="split", streamed=("block.0", "head")),
    _Case("streamed-fp32-resident", resident=("embedding",), streamed=("block.1", "block.2")),
    _Case("streamed-tied", tied=True, streamed=("embedding", "block.0", "block.2", "head")),
    _Case("streamed-tied-accum", tied=True, grad_accum=2, streamed=("embedding", "block.0", "block.2")),
]

_TOY_NAMES = {"embedding": "embed", "head": "head", **{f"block.{i}": f"layers.{i}" for i in range(3)}}
_BATCH, _SEQ, _CHUNK = 2, 16, 4096


def _optimizer(case: _Case) -> Optimizer:
    config = AdamWConfig(state_format=case.optimizer_state)
    if case.optimizer_state != "fp32":
        return CompactAdamW(config, fused=case.fused)
    return FusedAdamW(config) if case.fused else TorchAdamW(config)


def _plan_inputs(model: ToyModel, case: _Case, optimizer: Optimizer) -> PlanInputs:
    return PlanInputs(
        model,
        batch_size=_BATCH,
        seq_len=_SEQ,
        grad_accum=case.grad_accum,
        compute_dtype_bytes=case.compute_dtype.itemsize,
        block_slots=2,
        accelerator=False,
        transfer_chunk_numel=_CHUNK,
        grad_ring_slots=4,
        resident_units=case.resident,
        streamed_units=case.streamed,
        master_format=case.master_format,
        max_grad_norm=1.0 if case.clipping else 0.0,
        optimizer_state=case.optimizer_state,
        optimizer=optimizer,
        offload_optimizer="nvme" if case.state_on_tier else "ram",
        nvme_fraction=case.state_on_tier,
        offload_activations="nvme" if case.activations_on_tier else "ram",
    )


def _offloaded(model: ToyModel, case: _Case) -> tuple[str, ...]:
    """The engine's names of the units the planner puts on NVMe (blocks first, then the edges)."""
    if not case.state_on_tier:
        return ()
    ordered = [unit.name for unit in model.blocks] + [model.embedding.name, model.head.name]
    count = int(case.state_on_tier * len(ordered) + 0.5)
    return tuple(ordered[:count])


def _run(
    model: ToyModel, case: _Case, optimizer: Optimizer, log: _AllocationLog
) -> tuple[dict[str, int], HostAllocations]:
    """Build the engine, run two clipped steps, and return the live buffers by plan name, and what the
    engine's own ledger counts (``Engine.host_allocations``)."""
    resident = tuple(_TOY_NAMES[name] for name in case.resident)
    config = EngineConfig(
        block_slots=2,
        compute_dtype=case.compute_dtype,
        master_format=case.master_format,
        transfer_chunk_numel=_CHUNK,
        grad_ring_slots=4,
        resident_units=resident,
        offloaded_units=_offloaded(model, case),
        streamed_units=tuple(_TOY_NAMES[name] for name in case.streamed),
        max_grad_norm=1e-3 if case.clipping else 0.0,  # small: every step clips, so corrections run
    )
    generator = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    with CPUDevice() as device, HostRamTier() as state_tier, HostRamTier() as activation_tier:
        pinned = {"alloc": device.alloc_pinned} if case.pinned_master else {}
        host = HostParameters(model, master_format=case.master_format, **pinned)
        load_init(host, toy_init(model, seed=0))
        tiers = {"state_tier": state_tier, "activation_tier": activation_tier if case.activations_on_tier else None}
        with Engine(model, device, host, optimizer, config, **tiers) as engine:
            for _ in range(2):
                batches = []
                for _ in range(case.grad_accum):
                    ids = torch.randint(0, vocab, (_BATCH, _SEQ), generator=generator)
                    batches.append((ids, ids.clone()))
                engine.step(batches, lr=1e-3)
            engine.wait_idle()
            counted = engine.host_allocations
            live: collections.Counter[str] = collections.Counter()
            with log._lock:
                census = list(log.live.items())
            for site, nbytes in census:
                if nbytes:
                    live[_buffer(site)] += nbytes
            elsewhere = set(resident) | set(config.offloaded_units)
            for unit in model.units:  # allocated, never touched (see the module docstring)
                if unit.name in elsewhere:
                    views = engine.host_state.views(unit)
                    live["host/optimizer_state"] -= sum(v.numel() * v.element_size() for v in views.values())
                if unit.name in resident and not case.pinned_master:  # pages given back, but the page-locked spans'
                    kept = engine.pipelines.resident.kept_host
                    given_back = [part for r in host.unit_ranges(unit) for part in outside(r, kept)]
                    live["host/master_fp32"] -= sum(r.numel() * r.element_size() for r in given_back)
    return dict(live), counted


def _planned(inputs: PlanInputs) -> dict[str, int]:
    plan = make_plan(inputs)
    buffers = engine_buffers(inputs.shape, inputs)
    planned = {f"host/{k}": v for k, v in buffers.host.items()}
    planned.update({f"device/{k}": v for k, v in buffers.device.items()})
    planned["disk"] = plan.disk_bytes
    # the window's slots are one allocation site: the plan's three slot buffers together
    planned["device/slots"] = sum(planned.pop(f"device/{k}") for k in ("block_slots", "embedding_slot", "head_slot"))
    return planned


@pytest.mark.parametrize("case", _CASES, ids=[case.id for case in _CASES])
def test_plan_prices_every_buffer_the_engine_allocates(case, monkeypatch):
    if case.fused and not FusedAdamW.available():
        pytest.skip("the fused optimizers need numba")
    model = ToyModel(
        ToyConfig(
            vocab_size=512, hidden_size=64, num_heads=4, intermediate_size=128, num_layers=3, tie_embeddings=case.tied
        )
    )
    optimizer = _optimizer(case)
    warmup = getattr(optimizer, "warmup", None)
    if callable(warmup):
        warmup()
    allocation_log = _AllocationLog()
    allocation_log.install(monkeypatch)
    inputs = _plan_inputs(model, case, optimizer)
    planned = _planned(inputs)
    live, counted = _run(model, case, optimizer, allocation_log)
    # The resident update's scratch is priced at its peak, op temporaries included, which a census of live
    # buffers cannot see (tests/hf/test_planner.py measures that peak with AllocationCounter); what it keeps
    # must fit in it.
    assert live.pop("device/resident_scratch", 0) <= planned.pop("device/resident_scratch")
    # The streamed updates' staging sets (what StreamedPipeline reports) are allocated, and the plan covers
    # them and the optimizer replica's scratch, which it prices at its peak as the resident one's.
    staged = live.pop("device/streamed_staging", 0)
    assert staged <= planned.pop("device/streamed_staging")
    if case.streamed:
        from slide_core.engine.streamed_pipeline import StreamedPipeline

        numels = dict(
            zip(("embedding", *(f"block.{i}" for i in range(3)), "head"), inputs.shape.unit_numels, strict=True)
        )
        largest = max(numels[name] for name in case.streamed)
        assert (
            staged
            >= StreamedPipeline.device_bytes(largest, optimizer.state_arrays, split=case.master_format == "split")
            > 0
        )
    engine_side = {name: nbytes for name, nbytes in live.items() if nbytes}
    plan_side = {name: nbytes for name, nbytes in planned.items() if nbytes}
    assert engine_side == plan_side
    # The engine's own count of its host buffers is the plan's too, to the byte, but for the stand-in
    # tiers: a HostRamTier holds in RAM what the plan prices on disk.
    held = {
        f"host/{buffer}": nbytes - counted.owners[buffer].get("HostRamTier", 0)
        for buffer, nbytes in counted.buffers.items()
    }
    assert {k: v for k, v in held.items() if v} == {k: v for k, v in plan_side.items() if k.startswith("host/")}


def test_breakdowns_are_the_engine_buffers():
    """The plan's breakdowns hold every engine buffer under the same name (what the test above checks)."""
    model = ToyModel(ToyConfig(vocab_size=512, hidden_size=64, num_heads=4, intermediate_size=128, num_layers=3))
    inputs = PlanInputs(model, batch_size=_BATCH, seq_len=_SEQ, max_grad_norm=1.0, resident_units=("embedding",))
    plan = make_plan(inputs)
    buffers = engine_buffers(inputs.shape, inputs)
    assert set(buffers.host) == {*ENGINE_HOST_BUFFERS, "nvme_staging"}
    assert set(buffers.device) == set(ENGINE_DEVICE_BUFFERS)
    assert {k: plan.host_breakdown[k] for k in buffers.host} == buffers.host
    assert {k: plan.gpu_breakdown[k] for k in buffers.device} == buffers.device


def _staging_bytes(staging: UpdateStaging) -> int:
    """Device bytes an engine's staging holds: every set's master or planes and state, a split master's
    fp32 buffer and the summed gradients' pool."""
    tensors = [t for staged in staging.sets for t in (*staged.planes.values(), *staged.state.values())]
    tensors += [staged.master for staged in staging.sets if staged.master is not None]
    tensors += [staging.values] if staging.values is not None else []
    tensors += [held.values for held in staging.sums.buffers]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_the_plan_prices_a_tied_models_streamed_staging_as_the_engine_holds_it(grad_accum: int) -> None:
    """Every unit of a tied model streamed: the plan's streamed staging is, to the byte, what the engine's
    staging holds after its steps (its sets, and one summed gradient for the tied embedding alone, or one
    per set with accumulation: Note [One sum per summing unit in flight]) plus the device optimizer's
    scratch for the ranges it steps, which the plan prices at its peak."""
    from slide_core.engine.streamed_pipeline import StreamedPipeline

    case = _Case(
        "streamed-tied",
        tied=True,
        grad_accum=grad_accum,
        streamed=("embedding", "block.0", "block.1", "block.2", "head"),
    )
    model = ToyModel(
        ToyConfig(vocab_size=512, hidden_size=64, num_heads=4, intermediate_size=128, num_layers=3, tie_embeddings=True)
    )
    optimizer = _optimizer(case)
    planned = make_plan(_plan_inputs(model, case, optimizer)).gpu_breakdown["streamed_staging"]
    config = EngineConfig(
        compute_dtype=case.compute_dtype,
        transfer_chunk_numel=_CHUNK,
        streamed_units=tuple(_TOY_NAMES[name] for name in case.streamed),
    )
    generator = torch.Generator().manual_seed(0)
    with CPUDevice() as device:
        host = HostParameters(model)
        load_init(host, toy_init(model, seed=0))
        with Engine(model, device, host, optimizer, config) as engine:
            for _ in range(2):
                ids = [torch.randint(0, 512, (_BATCH, _SEQ), generator=generator) for _ in range(grad_accum)]
                engine.step([(i, i.clone()) for i in ids], lr=1e-3)
            engine.wait_idle()
            staging = engine.pipelines.streamed.staging
            held = _staging_bytes(staging)
    numel = {unit.name: unit.layout.numel for unit in model.units}
    sums = [held.values.numel() for held in staging.sums.buffers]
    assert sums == ([numel["embed"]] if grad_accum == 1 else [max(numel.values())] * len(staging.sets))
    largest = StreamedPipeline.optimizer_range_numel(max(numel.values()), _CHUNK, clipping=False)
    assert held == planned - optimizer.device_replica().device_scratch_bytes(largest)
