"""Each unit pipeline on its own, on the CPU device in fp32: no engine, no model compute. Gradients are
handed to a pipeline as a backward would hand them, and the updated master and optimizer state are
compared with ``torch.optim.AdamW`` on the same gradients (``clip_grad_norm_``'s coefficient applied by
hand where a step clips).

Covers slide_core/engine/{context,host_pipeline,state_store,resident_pipeline,clip_strategy}.py;
the orderings they rely on are Notes [Clip rollback ordering], [Deferred clipped steps], [Speculative
non-finite guard] and [Tied gradient in the slot] in docs/design/engine.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.collectives import SingleProcess
from slide_core.devices.cpu import CPUDevice
from slide_core.engine.clip_strategy import ClipPolicy, DeferredClipping, NoClipping, SpeculativeClipping
from slide_core.engine.clipping import CLIP_EPS
from slide_core.engine.config import EngineConfig
from slide_core.engine.context import Contribution, ContributionKind, StepContext
from slide_core.engine.grad_transfer import GradTransfer
from slide_core.engine.host_pipeline import HostPipeline
from slide_core.engine.host_state import HostState
from slide_core.engine.norms import UnitNorms
from slide_core.engine.pipeline import UnitPipeline
from slide_core.engine.resident import ResidentUnits
from slide_core.engine.resident_pipeline import ResidentPipeline
from slide_core.engine.shards import UnitShards
from slide_core.engine.slots import ParamSlot
from slide_core.engine.state_offload import OffloadedState
from slide_core.engine.state_store import TierStore
from slide_core.engine.timeline import ComputeTimer, Timeline
from slide_core.engine.workers import Workers
from slide_core.optim import TorchAdamW
from slide_core.testing import ToyConfig, ToyModel, load_init, toy_init
from slide_core.tiers.host_ram import HostRamTier
from slide_core.unit import Unit

ADAM = AdamWConfig(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
LR = 1e-2
RTOL = 1e-6  # one AdamW step's rounding; taking an update back costs a few ulp more
CHUNK = 1024


# ---- a rig: the parts an engine would build, for a few units --------------------------------------------
@dataclass
class _Rig:
    model: ToyModel
    device: CPUDevice
    host: HostParameters
    host_state: HostState
    workers: Workers
    norms: UnitNorms
    units: list[Unit]
    pipeline: UnitPipeline
    slots: dict[str, ParamSlot]
    transfer: GradTransfer | None = None

    def context(self, step: int, policy: ClipPolicy, micro_batches: int = 1, *, per_batch: int = 1) -> StepContext:
        expected = {unit.name: micro_batches * per_batch for unit in self.units}
        updated = {unit.name: Future() for unit in self.units}
        device_updated = frozenset(self.units_named() if isinstance(self.pipeline, ResidentPipeline) else ())
        return StepContext(step, LR, micro_batches, expected, policy.for_step(), updated, device_updated)

    def units_named(self) -> list[str]:
        return [unit.name for unit in self.units]

    def contribute(self, unit: Unit, grads: dict[str, torch.Tensor], contribution: Contribution, ctx: StepContext):
        self.pipeline.contribute(unit, self.slots[unit.name], grads, contribution, ctx)

    def wait(self, ctx: StepContext) -> None:
        for name, future in ctx.updated.items():
            self.workers.wait(future, f"the update of {name}")

    def finish(self, ctx: StepContext) -> float | None:
        squares = self.norms.on_device.tolist()
        last = self.transfer.last if self.transfer is not None else None
        routes = [(unit, self.pipeline) for unit in self.units]
        return ctx.clip.finish(ctx, squares, self.workers, routes, last)

    def state(self, unit: Unit) -> dict[str, torch.Tensor]:
        return {name: self.pipeline.state_array(unit, name).clone() for name in ("master", *TorchAdamW.state_names)}


@contextmanager
def _rig(
    kind: str,
    *,
    clipping: bool = False,
    tied: bool = False,
    optimizer=None,
    tier=None,
    unit_names=("layers.0", "layers.1"),
) -> Iterator[_Rig]:
    """``kind``: 'host', 'offloaded' or 'resident' pipeline for ``unit_names`` of a toy model."""
    model = ToyModel(ToyConfig(num_layers=2, tie_embeddings=tied))
    units = [unit for unit in model.units if unit.name in unit_names]
    optimizer = optimizer or TorchAdamW(ADAM)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=CHUNK, max_grad_norm=1.0 if clipping else 0)
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, toy_init(model, seed=3))
        elsewhere = set(unit_names) if kind != "host" else set()
        host_state = HostState(model, host, optimizer.state_names, elsewhere)
        host_state.zero_fresh()
        workers = Workers(("h2d", "d2h", "optimizer"), 20.0)
        timeline = Timeline(False)
        norms = UnitNorms(device, units)
        try:
            if kind == "resident":
                residents = ResidentUnits(
                    model, tuple(unit_names), device, host, dict.fromkeys(unit_names), optimizer.state_names,
                    torch.float32,
                )  # fmt: skip
                timer = ComputeTimer(device, timeline)
                pipeline = ResidentPipeline(
                    residents, optimizer.device_replica(), host, norms, timer, CHUNK, lean_host=False,
                    shards=UnitShards(SingleProcess(), units),
                )  # fmt: skip
                slots = {unit.name: residents.slot(unit.name) for unit in units}
                yield _Rig(model, device, host, host_state, workers, norms, units, pipeline, slots)
                return
            transfer = GradTransfer(device, workers, units, config, timeline, norms)
            parts = dict(
                device=device, host_params=host, host_state=host_state, optimizer=optimizer, transfer=transfer,
                workers=workers, norms=norms, timeline=timeline,
                forward_position={unit.name: index for index, unit in enumerate(model.units)}, chunk_numel=CHUNK,
                shards=UnitShards(SingleProcess(), units),
            )  # fmt: skip
            if kind == "offloaded":
                offloaded = OffloadedState(tier, units, optimizer.state_names, 20.0)
                pipeline = HostPipeline(**parts, store=TierStore(units, offloaded, host_state))
            else:
                pipeline = HostPipeline(**parts)
            slots = {}
            for index, unit in enumerate(units):
                slots[unit.name] = ParamSlot(
                    index,
                    device.empty(unit.layout.numel, torch.float32),
                    device.empty(unit.layout.numel, torch.float32),
                )
                slots[unit.name].grads.zero_()  # alignment padding stays zero, as the engine keeps it
            yield _Rig(model, device, host, host_state, workers, norms, units, pipeline, slots, transfer)
        finally:
            assert not workers.stop(abandon=False)


# ---- references ---------------------------------------------------------------------------------------
def _gradients(unit: Unit, seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {spec.name: torch.randn(spec.shape, generator=generator) * scale for spec in unit.layout}


def _flat(unit: Unit, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    flat = torch.zeros(unit.layout.numel)
    for name, view in unit.layout.views(flat).items():
        view.copy_(grads[name])
    return flat


def _adamw(unit: Unit, master: torch.Tensor, steps: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch.optim.AdamW over the unit's flat range, decay prefix and the rest as two parameter groups."""
    cut = unit.layout.decay_numel
    parts = [torch.nn.Parameter(master[:cut].clone()), torch.nn.Parameter(master[cut:].clone())]
    optimizer = torch.optim.AdamW(
        [{"params": [parts[0]], "weight_decay": ADAM.weight_decay}, {"params": [parts[1]], "weight_decay": 0.0}],
        lr=LR,
        betas=(ADAM.beta1, ADAM.beta2),
        eps=ADAM.eps,
        foreach=False,
    )
    for grad in steps:
        parts[0].grad, parts[1].grad = grad[:cut].clone(), grad[cut:].clone()
        optimizer.step()
    return {
        "master": torch.cat([p.detach() for p in parts]),
        "exp_avg": torch.cat([optimizer.state[p]["exp_avg"] for p in parts]),
        "exp_avg_sq": torch.cat([optimizer.state[p]["exp_avg_sq"] for p in parts]),
    }


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = RTOL) -> None:
    for name, tensor in want.items():
        err = float((got[name] - tensor).norm() / tensor.norm().clamp_min(1e-30))
        assert err <= rtol, f"{name}: relative error {err:.2e}"


# ---- what a contribution is ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("expected", "kinds"),
    [
        (1, ["ONLY"]),
        (2, ["FIRST", "LAST"]),
        (4, ["FIRST", "MIDDLE", "MIDDLE", "LAST"]),
    ],
)
def test_contribution_kinds(expected: int, kinds: list[str]) -> None:
    got = [Contribution.of(index, expected) for index in range(expected)]
    assert [c.kind for c in got] == [ContributionKind[kind] for kind in kinds]
    assert [c.index for c in got] == list(range(expected))
    assert [c.starts for c in got] == [index == 0 for index in range(expected)]
    assert [c.final for c in got] == [index == expected - 1 for index in range(expected)]


def test_step_context_orders_a_tied_embeddings_shares() -> None:
    """Two micro-batches of a tied model: the embedding gets the head's share, then its own, in each."""
    model = ToyModel(ToyConfig(tie_embeddings=True))
    expected = {unit.name: 2 for unit in model.units} | {"embed": 4}
    ctx = StepContext(3, LR, 2, expected, NoClipping(checks_norms=True, host_sq=None), {}, frozenset({"layers.1"}))
    order = [ctx.contribution(model.embedding, mb, share) for mb in (0, 1) for share in (0, 1)]
    assert [c.index for c in order] == [0, 1, 2, 3]
    assert [c.kind.name for c in order] == ["FIRST", "MIDDLE", "MIDDLE", "LAST"]
    assert ctx.contribution(model.head, 1).kind is ContributionKind.LAST
    assert ctx.summed_on_host("embed") and not ctx.summed_on_host("layers.1")  # device-resident


# ---- the host pipeline --------------------------------------------------------------------------------
@pytest.mark.parametrize("micro_batches", [1, 2, 3])
def test_host_pipeline_matches_adamw(micro_batches: int) -> None:
    """Two steps of summed contributions through the d2h stage and the optimizer thread; with several,
    the reported squared norm of the summed gradient comes from the host sum."""
    with _rig("host") as rig:
        initial = {unit.name: rig.host.flat(unit).clone() for unit in rig.units}
        sums: dict[str, list[torch.Tensor]] = {unit.name: [] for unit in rig.units}
        policy = ClipPolicy(EngineConfig())
        for step in (1, 2):
            ctx = rig.context(step, policy, micro_batches)
            for unit in rig.units:
                total = torch.zeros(unit.layout.numel)
                for mb in range(micro_batches):
                    grads = _gradients(unit, seed=100 * step + 10 * mb + len(unit.name))
                    rig.contribute(unit, grads, ctx.contribution(unit, mb), ctx)
                    total += _flat(unit, grads)
                sums[unit.name].append(total)
            norm = rig.finish(ctx)
            rig.wait(ctx)
            squares = [float(total.square().sum()) for total in (sums[unit.name][-1] for unit in rig.units)]
            assert norm == pytest.approx(math.sqrt(sum(squares)), rel=1e-6)
        for unit in rig.units:
            _assert_close(rig.state(unit), _adamw(unit, initial[unit.name], sums[unit.name]))


def test_host_pipeline_loads_only_after_the_update() -> None:
    """Note [Update futures]: a load waits for the unit's 'updated' future, then copies its master in."""
    with _rig("host") as rig:
        unit, ready = rig.units[0], Future()
        target = ParamSlot(
            9, rig.device.empty(unit.layout.numel, torch.float32), rig.device.empty(unit.layout.numel, torch.float32)
        )
        target.params.fill_(7.0)
        job = rig.workers["h2d"].submit(rig.pipeline.load, unit, target, ready, None)
        with pytest.raises(TimeoutError):
            job.result(timeout=0.2)
        assert bool((target.params == 7.0).all())
        ready.set_result(None)
        rig.workers.wait(job, "the load")
        assert torch.equal(target.params, rig.host.flat(unit))


def _clipped_reference(rig: _Rig, initial, grads, max_norm: float) -> tuple[float, dict[str, dict[str, torch.Tensor]]]:
    total = math.sqrt(sum(float(_flat(unit, grads[unit.name]).square().sum()) for unit in rig.units))
    coeff = min(1.0, max_norm / (total + CLIP_EPS))
    want = {unit.name: _adamw(unit, initial[unit.name], [_flat(unit, grads[unit.name]) * coeff]) for unit in rig.units}
    return total, want


@pytest.mark.parametrize("kind", ["host", "resident"])
def test_speculative_clipping_is_corrected_to_the_global_coefficient(kind: str) -> None:
    """Each unit applies its own ``c_u`` at once; the decision rescales it to the step's ``c`` (through
    ``Optimizer.correct``) and bets that the next step clips too (Note [Deferred clipped steps])."""
    with _rig(kind, clipping=True) as rig:
        initial = {unit.name: rig.host.flat(unit).clone() for unit in rig.units}
        grads = {unit.name: _gradients(unit, seed=5 + index) for index, unit in enumerate(rig.units)}
        policy = ClipPolicy(EngineConfig(max_grad_norm=1.0))
        ctx = rig.context(1, policy)
        assert isinstance(ctx.clip, SpeculativeClipping) and not isinstance(ctx.clip, DeferredClipping)
        for unit in rig.units:
            rig.contribute(unit, grads[unit.name], ctx.contribution(unit, 0), ctx)
        norm = rig.finish(ctx)
        rig.wait(ctx)
        total, want = _clipped_reference(rig, initial, grads, 1.0)
        assert total > 1.0, "test setup: the step must clip"
        assert norm == pytest.approx(total, rel=1e-6)
        assert policy.defer_next
        for unit in rig.units:
            _assert_close(rig.state(unit), want[unit.name], rtol=1e-5)


def test_deferred_clipping_holds_host_updates_until_the_decision() -> None:
    """Note [Deferred clipped steps]: nothing is applied before the norm is known; then each range once,
    with the final coefficient."""

    class Counting(TorchAdamW):
        calls = 0

        def step(self, *args, **kwargs) -> None:
            type(self).calls += 1
            super().step(*args, **kwargs)

    with _rig("host", clipping=True, optimizer=Counting(ADAM)) as rig:
        initial = {unit.name: rig.host.flat(unit).clone() for unit in rig.units}
        grads = {unit.name: _gradients(unit, seed=21 + index) for index, unit in enumerate(rig.units)}
        policy = ClipPolicy(EngineConfig(max_grad_norm=1.0))
        policy.defer_next = True
        ctx = rig.context(1, policy)
        assert isinstance(ctx.clip, DeferredClipping)
        for unit in rig.units:
            rig.contribute(unit, grads[unit.name], ctx.contribution(unit, 0), ctx)
        rig.workers.wait(rig.transfer.last, "the transfers")
        rig.workers.wait(rig.workers["optimizer"].submit(lambda: None, priority=(1, 1)), "the held chunks")
        assert Counting.calls == 0
        assert all(torch.equal(rig.host.flat(unit), initial[unit.name]) for unit in rig.units)
        assert not any(future.done() for future in ctx.updated.values())
        rig.finish(ctx)
        rig.wait(ctx)
        assert Counting.calls == sum(len(ctx.clip.held[unit.name]) for unit in rig.units)
        _, want = _clipped_reference(rig, initial, grads, 1.0)
        for unit in rig.units:
            _assert_close(rig.state(unit), want[unit.name])


@pytest.mark.parametrize("kind", ["host", "resident"])
def test_a_nonfinite_step_is_taken_back(kind: str) -> None:
    """Note [Speculative non-finite guard]: the unit updated before the NaN arrived is taken back, the
    NaN unit is never applied (host) or applied as zeros and taken back (device); the step is skipped."""
    with _rig(kind, clipping=True) as rig:
        before = {unit.name: rig.state(unit) for unit in rig.units}
        first, second = rig.units
        policy = ClipPolicy(EngineConfig(max_grad_norm=1e6))
        ctx = rig.context(1, policy)
        rig.contribute(first, _gradients(first, seed=1), ctx.contribution(first, 0), ctx)
        poisoned = _gradients(second, seed=2)
        next(iter(poisoned.values())).view(-1)[3] = math.nan
        rig.contribute(second, poisoned, ctx.contribution(second, 0), ctx)
        norm = rig.finish(ctx)
        rig.wait(ctx)
        assert ctx.clip.skipped and math.isnan(norm)
        assert policy.nonfinite_streak == 1 and not policy.defer_next
        for unit in rig.units:
            after = rig.state(unit)
            _assert_close(after, {"master": before[unit.name]["master"]})
            assert not after["exp_avg"].any() and not after["exp_avg_sq"].any()  # step 1: Adam's fresh state


def test_offloaded_pipeline_matches_the_host_pipeline_bit_for_bit() -> None:
    """The same gradients through state staged from a tier give the host slabs' bits (Note [Staging reuse
    ordering] in state_offload.py: two units, two staging sets, three steps)."""
    results = []
    with HostRamTier() as tier:
        for kind in ("host", "offloaded"):
            with _rig(kind, tier=tier) as rig:
                policy = ClipPolicy(EngineConfig())
                for step in (1, 2, 3):
                    ctx = rig.context(step, policy, 2)
                    for unit in rig.units:
                        for mb in (0, 1):
                            grads = _gradients(unit, seed=7 * step + mb + len(unit.name))
                            rig.contribute(unit, grads, ctx.contribution(unit, mb), ctx)
                    rig.finish(ctx)
                    rig.wait(ctx)
                rig.pipeline.flush()
                results.append({unit.name: rig.state(unit) for unit in rig.units})
    for unit, arrays in results[0].items():
        for name, tensor in arrays.items():
            assert torch.equal(results[1][unit][name], tensor), (unit, name)


# ---- the resident pipeline ----------------------------------------------------------------------------
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_resident_pipeline_sums_a_tied_embedding(micro_batches: int) -> None:
    """A tied embedding's two shares per micro-batch: with one micro-batch they are summed in the slot
    (Note [Tied gradient in the slot]; the second is not written in place), with two in an fp32
    accumulator. Each update is final at once: its future resolves on the compute stream's turn."""
    with _rig("resident", tied=True, unit_names=("embed",)) as rig:
        (unit,) = rig.units
        initial = rig.host.flat(unit).clone()
        policy = ClipPolicy(EngineConfig())
        sums = []
        for step in (1, 2):
            ctx = rig.context(step, policy, micro_batches, per_batch=2)
            total = torch.zeros(unit.layout.numel)
            for mb in range(micro_batches):
                for share in (0, 1):
                    contribution = ctx.contribution(unit, mb, share)
                    in_place = rig.pipeline.writable_grads(unit, rig.slots[unit.name], contribution, ctx)
                    assert (in_place is None) == (micro_batches == 1 and share == 1)
                    assert not ctx.updated[unit.name].done()
                    grads = _gradients(unit, seed=31 * step + 2 * mb + share)
                    rig.contribute(unit, grads, contribution, ctx)
                    total += _flat(unit, grads)
            assert ctx.updated[unit.name].done()
            sums.append(total)
        assert (rig.pipeline.units.units[unit.name].accum is None) == (micro_batches == 1)
        _assert_close(rig.state(unit), _adamw(unit, initial, sums))
        assert torch.equal(rig.slots[unit.name].params, rig.state(unit)["master"])  # the compute copy


def test_resident_checkpoint_round_trip() -> None:
    """``restore_target``/``restored`` write a unit's arrays where it lives, and the compute copy follows
    the master; ``sync_to_host`` brings master and state back to the host slabs."""
    with _rig("resident", unit_names=("layers.1",)) as rig:
        (unit,) = rig.units
        saved = {name: torch.randn(unit.layout.numel) for name in ("master", "exp_avg", "exp_avg_sq")}
        for name, values in saved.items():
            target = rig.pipeline.restore_target(unit, name)
            target.copy_(values)
            rig.pipeline.restored(unit, name, target)
        assert torch.equal(rig.slots[unit.name].params, saved["master"])
        rig.pipeline.sync_to_host(rig.host_state)
        assert torch.equal(rig.host.flat(unit), saved["master"])
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(rig.host_state.views(unit)[name], saved[name])


def test_offloaded_checkpoint_round_trip() -> None:
    """A resumed unit's state goes to the tier whole (not to the host slabs), and is read back from there;
    a unit never written reads as Adam's zeros."""
    with HostRamTier() as tier, _rig("offloaded", tier=tier) as rig:
        resumed, fresh = rig.units
        saved = {name: torch.randn(resumed.layout.numel) for name in ("exp_avg", "exp_avg_sq")}
        for view in rig.host_state.views(resumed).values():
            view.fill_(-1.0)
        for name, values in saved.items():
            target = rig.pipeline.restore_target(resumed, name)
            assert target.data_ptr() != rig.host_state.views(resumed)[name].data_ptr()
            target.copy_(values)
            rig.pipeline.restored(resumed, name, target)
        assert all(bool((view == -1.0).all()) for view in rig.host_state.views(resumed).values())
        for name, values in saved.items():
            assert torch.equal(rig.pipeline.state_array(resumed, name), values)
            assert not rig.pipeline.state_array(fresh, name).any()
