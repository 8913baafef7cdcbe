"""Data parallel (slide_core/distributed.py, slide_core/engine/host_pipeline.py) on the CPU device with
gloo, in real processes: N ranks, each stepping on its rows of every step's global batch, against one
process stepping on the whole batch, in fp32: per-step losses and gradient norms, skipped steps and the
final weights, with and without clipping, with gradient accumulation and with a tied embedding, for 2
ranks (even shards) and 3 (odd shards); and with bf16 Adam state (CompactAdamW). And a rank killed mid-run stops the others, each with a line
naming it (Note [Collective failures]).

This file is also the rank's program: ``python test_distributed.py SPEC.json`` with torchrun's variables in
the environment (``_launch`` sets them) runs the cases of SPEC and saves each rank's results.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.checkpoint import load_checkpoint, save_checkpoint
from slide_core.devices.cpu import CPUDevice
from slide_core.distributed import ProcessGroupContext, shard_span
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.optim.compact_adamw import CompactAdamW
from slide_core.testing import ToyBlock, ToyConfig, ToyModel, launch_ranks, toy_batches, toy_init, wait_ranks
from slide_core.tiers.host_ram import HostRamTier

RTOL = 1e-5
LR = 3e-3
ROWS_PER_RANK = 2
LAUNCH_TIMEOUT_S = 150.0


@dataclass(frozen=True)
class Case:
    tied: bool = False
    accum: int = 1
    max_grad_norm: float = 0.0
    poison_step: int = 0
    """The step whose gradients turn NaN on the last rank only (0: none)."""
    steps: int = 3
    resident: tuple[str, ...] = ()
    """Device-resident units (resident_pipeline.py)."""
    offloaded: tuple[str, ...] = ()
    """Units whose Adam state lives on a tier (the ram-backed stand-in of NVMe)."""
    streamed: tuple[str, ...] = ()
    """Units updated on the device as they stream (streamed_pipeline.py)."""
    to_root: bool = False
    """The engine closes with ``master_to_root``: only rank 0's master is gathered whole."""
    streamable: tuple[str, ...] = ()
    """Units the run may move between the host and the device update between steps."""
    moves: tuple[tuple[int, tuple[str, ...]], ...] = ()
    """``(step, units)``: after ``step``, every rank updates ``units`` on the device (``Engine.place_streamed``)
    and the other streamable ones on the host (Note [Re-placement at a step boundary])."""
    state_format: str = "fp32"
    """How the Adam moments are stored (``bf16``: CompactAdamW, rounded stochastically by element index)."""
    master_rtol: float = RTOL
    """How close the final weights must be to one process's. A device-resident unit under data parallel
    steps with a speculative coefficient from its shard's own norm, where one process uses the unit's, and
    a clipped step's correction takes that update back exactly only to the rounding of the stored moments
    (bf16: ~2^-9, slide_core/optim/compact_adamw.py), so with compact state its weights agree to that."""

    def optimizer(self) -> TorchAdamW | CompactAdamW:
        adam = AdamWConfig(weight_decay=0.1, state_format=self.state_format)
        return TorchAdamW(adam) if self.state_format == "fp32" else CompactAdamW(adam)

    def config(self) -> EngineConfig:
        return EngineConfig(
            compute_dtype=torch.float32,
            transfer_chunk_numel=1024,
            max_grad_norm=self.max_grad_norm,
            timeout_s=60.0,
            resident_units=self.resident,
            offloaded_units=self.offloaded,
            streamed_units=self.streamed,
            streamable_units=self.streamable,
        )


MOVABLE = ("embed", "layers.0", "layers.1", "layers.2", "head")
"""The units of the re-placement cases' streamed path."""

CASES = {
    "plain": Case(),
    "clips": Case(max_grad_norm=0.05),  # clips every step: speculative, then deferred steps
    "accum": Case(accum=2),  # host-summed norms, reported
    "tied": Case(tied=True),  # the embedding sums the head's share on the host
    "tied-accum-clips": Case(tied=True, accum=2, max_grad_norm=0.05),
    "nan-on-one-rank": Case(max_grad_norm=1e6, poison_step=2, steps=4),
    "resident": Case(resident=("embed", "layers.0")),
    "resident-tied-accum-clips": Case(tied=True, accum=2, max_grad_norm=0.05, resident=("embed", "head")),
    "nvme": Case(offloaded=("layers.0", "layers.2")),
    "to-rank-0": Case(max_grad_norm=0.05, resident=("embed",), offloaded=("layers.2",), to_root=True),
    "nvme-resident-accum-clips": Case(
        accum=2, max_grad_norm=0.05, offloaded=("layers.1", "head"), resident=("embed", "layers.2")
    ),
    "bf16-state": Case(state_format="bf16"),
    "bf16-state-nvme-accum-clips": Case(state_format="bf16", accum=2, max_grad_norm=0.05, offloaded=("layers.1",)),
    "bf16-state-resident-clips": Case(state_format="bf16", max_grad_norm=0.05, resident=("embed",), master_rtol=1e-3),
    "streamed": Case(streamed=("layers.0", "layers.2", "head"), resident=("embed",)),  # shards updated on the device
    "bf16-state-streamed-nvme": Case(state_format="bf16", streamed=("layers.0", "head"), offloaded=("layers.2",)),
    # several contributions: the earlier ones summed on the host, the last on the device (Note [Streamed accumulation])
    "streamed-accum": Case(accum=2, streamed=("layers.1", "head")),
    "streamed-tied-accum-clips": Case(
        tied=True, accum=2, max_grad_norm=0.05, streamed=("embed", "layers.0", "layers.2")
    ),
    "streamed-accum-nan-on-one-rank": Case(
        accum=2, max_grad_norm=1e6, poison_step=2, steps=4, streamed=("embed", "layers.1", "head")
    ),
    # speculative device updates of the shards, corrected on the host (Note [Streamed speculation])
    "streamed-clips": Case(max_grad_norm=0.05, streamed=("layers.0", "layers.2", "head"), resident=("embed",)),
    "streamed-nan-on-one-rank": Case(max_grad_norm=1e6, poison_step=2, steps=4, streamed=("embed", "layers.2")),
    # every rank moves the same units between its steps: the bits of one process making the same moves
    "moved": Case(steps=4, streamable=MOVABLE, moves=((1, ("layers.0", "layers.1")), (2, ("embed", "head")))),
    "moved-tied-accum-clips": Case(
        tied=True,
        accum=2,
        max_grad_norm=0.05,
        steps=4,
        streamed=("layers.2",),
        streamable=("embed", "layers.0", "layers.1", "head"),
        moves=((1, ("embed", "layers.1")), (3, ())),
    ),
}
CHECKPOINT_CASES = {"clips-4": Case(max_grad_norm=0.05, steps=4)}
RESHARD_CASE = Case(accum=2, max_grad_norm=0.05, steps=4, resident=("embed",), offloaded=("layers.1",))
"""Saved after step 2 by one world size, resumed by another: clipping (the saved step defers its
successor's updates, Note [Deferred clipped steps]), accumulation (host-summed gradients), and a unit of
each placement (host, device-resident, Adam state on a tier)."""
RESHARD_ROWS = 6
"""The global batch of the resharding runs: rows for 1, 2 and 3 ranks alike."""


# ---- the model, the batches and one run, shared by the ranks and the one-process reference ---------------
class _PoisonGrad(torch.autograd.Function):
    """Identity forward; NaN backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, math.nan)


class _PoisonableBlock(ToyBlock):
    poisoned = False

    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs) -> torch.Tensor:
        y = super().forward(params, x, inputs)
        return _PoisonGrad.apply(y) if self.poisoned and torch.is_grad_enabled() else y


def _model(case: Case) -> ToyModel:
    model = ToyModel(ToyConfig(tie_embeddings=case.tied, num_layers=3))
    model.blocks[1] = _PoisonableBlock(model.cfg, 1)
    return model


def _global_batches(case: Case, world_size: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every step's global batch: ``world_size * ROWS_PER_RANK`` rows per micro-batch (the first row has a
    masked prompt, so the ranks' label-token counts differ)."""
    cfg = ToyConfig(tie_embeddings=case.tied, num_layers=3)
    return toy_batches(cfg, case.steps, case.accum, seed=5, batch=world_size * ROWS_PER_RANK)


def _load(host: HostParameters, group: ProcessGroupContext | None) -> bool:
    """The initial weights; a rank writes only its shards (``keep_shards``, Note [Sharded master]).
    Returns whether the master outside the shards kept, bit for bit, what its allocation held."""
    init = toy_init(host.model, seed=4)
    before = {}
    if group is not None:
        host.keep_shards({unit.name: group.span(unit.layout.numel) for unit in host.model.units})
        before = {unit.name: host.read(unit).clone().view(torch.int32) for unit in host.model.units}
    for unit in host.model.units:
        with host.editing(unit) as views:
            for name, view in views.items():
                view.copy_(init[unit.name][name])
    for name, was in before.items():
        lo, hi = group.span(was.numel()) if group is not None else (0, 0)
        now = host.read(name).view(torch.int32)
        if not (torch.equal(now[:lo], was[:lo]) and torch.equal(now[hi:], was[hi:])):
            return False
    return True


def _run(
    case: Case,
    batches,
    group: ProcessGroupContext | None,
    poisons: bool,
    die_after: int = 0,
    obituary: Path | None = None,
) -> dict:
    """Train on ``batches`` (this process's rows); return the step results, the final master and the
    optimizer state slabs (NaN wherever they were never written). ``die_after``: the step after which
    this process writes the time to ``obituary`` and kills itself."""
    model = _model(case)
    config = case.config()
    optimizer = case.optimizer()
    results = []
    with CPUDevice() as device, HostRamTier() as tier:
        host = HostParameters(model)
        untouched = _load(host, group)
        engine = Engine(model, device, host, optimizer, config, state_tier=tier, process_group=group)
        for slab in engine.host_state.state_slabs.values():
            slab.fill_(math.nan)  # a fresh run zeroes the state it will update; the rest stays NaN
        with engine:
            for step, micro in enumerate(batches, start=1):
                model.blocks[1].poisoned = poisons and step == case.poison_step
                result = engine.step(micro, lr=LR)
                results.append((result.step, result.loss, result.grad_norm, result.skipped, result.loss_tokens))
                for after, units in case.moves:
                    if step == after:
                        engine.place_streamed(units)
                if step == die_after:
                    assert obituary is not None
                    obituary.write_text(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
            store = engine.transfer.store
            in_ram = [unit for unit in model.units if unit.name not in (*case.resident, *case.offloaded)]
            state = {unit.name: {k: v.clone() for k, v in engine.host_state.views(unit).items()} for unit in in_ram}
            if case.to_root:
                engine.close(master_to_root=True)
        master = {unit.name: host.flat(unit).clone() for unit in model.units}
        on_tier = {key: held.numel() for key, held in tier._store.items()}
    return {
        "results": results,
        "master": master,
        "state": state,
        "on_tier": on_tier,
        "untouched": untouched,
        "store_bytes": 0 if store is None else store.nbytes,
    }


def _checkpointed_run(case: Case, batches, group: ProcessGroupContext, out: Path) -> dict:
    """This rank's shards saved after 2 steps (with a drain that gathers the master), then the remaining
    steps in fresh engines restored from it; and the same steps uninterrupted."""
    config = EngineConfig(
        compute_dtype=torch.float32, transfer_chunk_numel=1024, max_grad_norm=case.max_grad_norm, timeout_s=60.0
    )

    def engine_for(device: CPUDevice) -> tuple[Engine, HostParameters]:
        model = _model(case)
        host = HostParameters(model)
        _load(host, group)
        return Engine(model, device, host, TorchAdamW(AdamWConfig(weight_decay=0.1)), config, process_group=group), host

    def steps(engine: Engine, micro_batches) -> list[tuple]:
        return [_as_row(engine.step(micro, lr=LR)) for micro in micro_batches]

    with CPUDevice() as device:
        engine, host = engine_for(device)
        with engine:
            straight = steps(engine, batches)
        straight_master = host.slab.clone()
        engine, host = engine_for(device)
        with engine:
            resumed = steps(engine, batches[:2])
            path = save_checkpoint(out / f"rank-{group.rank}", 2, engine.checkpoint_arrays(), engine.schedule_state())
            engine.drain(with_state=True)
            drained = host.slab.clone()
        engine, host = engine_for(device)
        with engine:
            state = engine.restore_checkpoint(path)
            engine.restore_schedule_state(state["extra"])
            resumed += steps(engine, batches[2:])
        resumed_master = host.slab.clone()
    master_numel = sum(hi - lo for lo, hi in state["shards"][0]["parts"]["master"]["intervals"])
    return {
        "straight": straight,
        "resumed": resumed,
        "straight_master": straight_master,
        "resumed_master": resumed_master,
        "drained": drained,
        "master_numel": master_numel,
    }


def _reshard_engine(
    device: CPUDevice, tier: HostRamTier, group: ProcessGroupContext | None
) -> tuple[Engine, HostParameters]:
    model = _model(RESHARD_CASE)
    host = HostParameters(model)
    _load(host, group)
    optimizer = TorchAdamW(AdamWConfig(weight_decay=0.1))
    return Engine(model, device, host, optimizer, RESHARD_CASE.config(), tier, process_group=group), host


def _reshard_batches(rank: int, world_size: int):
    """This rank's rows of the resharding runs' global batches (``RESHARD_ROWS`` rows per micro-batch)."""
    cfg = ToyConfig(num_layers=3)
    batches = toy_batches(cfg, RESHARD_CASE.steps, RESHARD_CASE.accum, seed=6, batch=RESHARD_ROWS)
    per_rank = RESHARD_ROWS // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return [[(ids[rows], labels[rows]) for ids, labels in micro] for micro in batches]


def _reshard_save(group: ProcessGroupContext | None, root: Path) -> list[tuple]:
    """The first 2 steps of the resharding runs, then their checkpoint: every rank's shards under a
    manifest (one process: one shard of every unit whole)."""
    rank, world_size = (0, 1) if group is None else (group.rank, group.world_size)
    with CPUDevice() as device, HostRamTier() as tier:
        engine, _ = _reshard_engine(device, tier, group)
        with engine:
            rows = [_as_row(engine.step(micro, lr=LR)) for micro in _reshard_batches(rank, world_size)[:2]]
            arrays, state = engine.checkpoint_arrays(), engine.schedule_state()
            save_checkpoint(root, 2, arrays, state, group)
    return rows


def _reshard_resume(group: ProcessGroupContext | None, step_dir: Path, resave: Path | None = None) -> dict:
    """Steps 3 and 4 of the resharding runs from ``step_dir``, whoever wrote it, and the final master.
    ``resave``: first save what was restored there again, before any step (by every rank)."""
    rank, world_size = (0, 1) if group is None else (group.rank, group.world_size)
    with CPUDevice() as device, HostRamTier() as tier:
        engine, host = _reshard_engine(device, tier, group)
        with engine:
            state = engine.restore_checkpoint(step_dir)
            engine.restore_schedule_state(state["extra"])
            if resave is not None:
                save_checkpoint(resave, 2, engine.checkpoint_arrays(), {}, group)
            rows = [_as_row(engine.step(micro, lr=LR)) for micro in _reshard_batches(rank, world_size)[2:]]
        return {"results": rows, "master": host.slab.clone()}


def _as_row(result) -> tuple:
    return (result.step, result.loss, result.grad_norm, result.skipped, result.loss_tokens)


def _rank_rows(batches, rank: int):
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return [[(ids[rows], labels[rows]) for ids, labels in micro] for micro in batches]


def _rank_main(spec: dict) -> None:
    """One rank: run every case of ``spec`` and save this rank's results (or die where told to)."""
    group = ProcessGroupContext.from_env("cpu", timeout_s=spec["timeout_s"])
    out = Path(spec["out"])
    with group:
        if spec.get("reshard_save"):
            _reshard_save(group, Path(spec["reshard_save"]))
            return
        if spec.get("reshard_resume"):
            resave = Path(spec["resave"]) if spec.get("resave") else None
            resumed = {
                name: _reshard_resume(group, Path(path), None if resave is None else resave / name)
                for name, path in spec["reshard_resume"].items()
            }
            torch.save(resumed, out / f"resharded-rank{group.rank}.pt")
            return
        if spec.get("checkpoint"):
            case = CHECKPOINT_CASES[spec["checkpoint"]]
            batches = _rank_rows(_global_batches(case, group.world_size), group.rank)
            torch.save(_checkpointed_run(case, batches, group, out), out / f"checkpoint-rank{group.rank}.pt")
            return
        for name in spec["cases"]:
            case = CASES[name]
            batches = _rank_rows(_global_batches(case, group.world_size), group.rank)
            poisons = group.rank == group.world_size - 1
            die_after = 1 if spec.get("kill_rank") == group.rank else 0  # then dies without a word
            run = _run(case, batches, group, poisons, die_after, out / "died-at")
            torch.save(run, out / f"{name}-rank{group.rank}.pt")


# ---- launching ranks --------------------------------------------------------------------------------
def _launch(world_size: int, spec: dict, out: Path) -> list[subprocess.Popen]:
    """Start ``world_size`` ranks of this file as torchrun would (its environment variables)."""
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    return launch_ranks([sys.executable, __file__, str(spec_path)], world_size)


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def ranks(request, tmp_path_factory) -> tuple[int, Path]:
    """Every case, run once by ``request.param`` ranks."""
    world_size = request.param
    out = tmp_path_factory.mktemp(f"dp{world_size}")
    spec = {"cases": list(CASES), "timeout_s": 30.0}
    for rank, (code, err) in enumerate(wait_ranks(_launch(world_size, spec, out), LAUNCH_TIMEOUT_S)):
        assert code == 0, f"rank {rank} of {world_size} failed:\n{err[-3000:]}"
    return world_size, out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# ---- the tests --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_ranks_match_one_process_at_the_global_batch(ranks: tuple[int, Path], name: str) -> None:
    world_size, out = ranks
    case = CASES[name]
    batches = _global_batches(case, world_size)
    want = _run(case, batches, None, poisons=True)
    for rank in range(world_size):
        got = torch.load(out / f"{name}-rank{rank}.pt")
        for (step, loss, norm, skipped, tokens), ref in zip(got["results"], want["results"], strict=True):
            ref_step, ref_loss, ref_norm, ref_skipped, ref_tokens = ref
            where = f"rank {rank}, step {ref_step}"
            assert (step, skipped, tokens) == (ref_step, ref_skipped, ref_tokens), where
            assert loss == pytest.approx(ref_loss, rel=RTOL), f"loss differs at {where}"
            if math.isfinite(ref_norm):
                assert norm == pytest.approx(ref_norm, rel=RTOL), f"grad norm differs at {where}"
            else:
                assert not math.isfinite(norm), where
        for unit, master in want["master"].items():
            lo, hi = (0, master.numel())
            if case.to_root and rank != 0:  # only rank 0 gathered the whole master; the others keep shards
                lo, hi = shard_span(master.numel(), rank, world_size)
            assert _rel(got["master"][unit][lo:hi], master[lo:hi]) <= case.master_rtol, f"rank {rank}: {unit} differs"
    if case.poison_step:
        assert [skipped for _, _, _, skipped, _ in want["results"]] == [False, True, False, False]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["clips", "nvme-resident-accum-clips"])
def test_each_rank_keeps_only_its_shards_of_the_clipping_store(ranks: tuple[int, Path], name: str) -> None:
    """With clipping, the pinned store that keeps the step's gradient until the norm is known holds a
    rank's shards of every host-updated unit (fp32 here: 4 bytes each), not the whole model."""
    world_size, out = ranks
    case = CASES[name]
    model = _model(case)
    host_units = [unit for unit in model.units if unit.name not in case.resident]
    for rank in range(world_size):
        spans = [shard_span(unit.layout.numel, rank, world_size) for unit in host_units]
        got = torch.load(out / f"{name}-rank{rank}.pt")["store_bytes"]
        assert got == 4 * max(1, sum(hi - lo for lo, hi in spans)), f"rank {rank}"
        assert got < 4 * sum(unit.layout.numel for unit in host_units) / (world_size - 0.5)


@pytest.mark.slow
def test_each_rank_writes_only_its_shards_optimizer_state(ranks: tuple[int, Path]) -> None:
    """Every rank zeroes and updates the Adam state of its own shard of each unit and never touches the
    rest (whose pages then cost it no memory); its host master held only its shards until the engine
    started (Note [Sharded master])."""
    world_size, out = ranks
    model = _model(CASES["plain"])
    for rank in range(world_size):
        run = torch.load(out / f"plain-rank{rank}.pt")
        assert run["untouched"], f"rank {rank} wrote its master outside its shards"
        state = run["state"]
        for unit in model.units:
            lo, hi = shard_span(unit.layout.numel, rank, world_size)
            assert 0 < hi - lo < unit.layout.numel
            for name, flat in state[unit.name].items():
                assert flat[lo:hi].isfinite().all(), f"rank {rank}: {unit.name} {name} not written"
                outside = torch.cat((flat[:lo], flat[hi:]))
                assert outside.isnan().all(), f"rank {rank}: {unit.name} {name} written outside its shard"


@pytest.mark.slow
def test_a_tier_holds_only_each_ranks_shards(ranks: tuple[int, Path]) -> None:
    """NVMe-offloaded Adam state under data parallel: each rank's tier keeps its shard of each offloaded
    unit's m and v, nothing else."""
    world_size, out = ranks
    case = CASES["nvme"]
    model = _model(case)
    for rank in range(world_size):
        on_tier = torch.load(out / f"nvme-rank{rank}.pt")["on_tier"]
        want = {}
        for unit in model.units:
            if unit.name in case.offloaded:
                lo, hi = shard_span(unit.layout.numel, rank, world_size)
                want.update({f"{unit.name}/exp_avg": hi - lo, f"{unit.name}/exp_avg_sq": hi - lo})
        assert on_tier == want, f"rank {rank}"


@pytest.mark.slow
def test_a_checkpoint_of_each_ranks_shards_resumes_bit_identically(tmp_path: Path) -> None:
    """Each of 2 ranks saves its shards of the master and the Adam state after 2 clipped steps (the next
    step defers its updates: Note [Deferred clipped steps]), fresh engines restore them, and the next 2
    steps and the final weights equal an uninterrupted run's bit for bit. The drain before leaving gathers
    the whole master on every rank."""
    spec = {"cases": [], "checkpoint": "clips-4", "timeout_s": 30.0}
    for rank, (code, err) in enumerate(wait_ranks(_launch(2, spec, tmp_path), LAUNCH_TIMEOUT_S)):
        assert code == 0, f"rank {rank} of 2 failed:\n{err[-3000:]}"
    model = _model(CHECKPOINT_CASES["clips-4"])
    runs = [torch.load(tmp_path / f"checkpoint-rank{rank}.pt") for rank in range(2)]
    for rank, run in enumerate(runs):
        assert len(run["resumed"]) == 4
        assert run["resumed"] == run["straight"], f"rank {rank}: the resumed steps differ"
        assert torch.equal(run["resumed_master"], run["straight_master"]), f"rank {rank}: the final weights differ"
        shards = sum(-(-unit.layout.numel // 2) if rank == 0 else unit.layout.numel // 2 for unit in model.units)
        assert run["master_numel"] == shards  # this rank's shards only
        assert (tmp_path / f"rank-{rank}" / "step-00000002" / "state.json").exists()
    assert torch.equal(runs[0]["drained"], runs[1]["drained"])  # the drain gathered one whole master
    assert runs[0]["straight"][1][1] != runs[0]["straight"][2][1]  # the steps do move the weights


@pytest.mark.slow
def test_a_checkpoint_resumes_at_another_world_size(tmp_path: Path) -> None:
    """A checkpoint of 2 ranks (clipping and accumulation on) resumes on 3 ranks and on one process, and a
    one-process checkpoint on 3 ranks: each continues with the uninterrupted run's losses, gradient norms
    and final weights (summation orders differ between world sizes: 1e-5 relative)."""
    straight_master, straight = _reshard_straight()
    saved_by_one = _reshard_save(None, tmp_path / "one")
    assert saved_by_one == straight[:2]
    for rank, (code, err) in enumerate(
        wait_ranks(
            _launch(2, {"reshard_save": str(tmp_path / "two"), "timeout_s": 30.0}, tmp_path / "a"), LAUNCH_TIMEOUT_S
        )
    ):
        assert code == 0, f"rank {rank} of 2 failed:\n{err[-3000:]}"
    by_two, by_one = tmp_path / "two" / "step-00000002", tmp_path / "one" / "step-00000002"
    assert sorted(p.name for p in by_two.iterdir()) == [
        "shard-00000-of-00002.bin",
        "shard-00001-of-00002.bin",
        "state.json",
    ]
    spec = {"reshard_resume": {"two": str(by_two), "one": str(by_one)}, "timeout_s": 30.0}
    for rank, (code, err) in enumerate(wait_ranks(_launch(3, spec, tmp_path / "b"), LAUNCH_TIMEOUT_S)):
        assert code == 0, f"rank {rank} of 3 failed:\n{err[-3000:]}"
    resumed = {
        f"{name} on 3 ranks, rank {rank}": run
        for rank in range(3)
        for name, run in torch.load(tmp_path / "b" / f"resharded-rank{rank}.pt").items()
    }
    resumed["two on one process"] = _reshard_resume(None, by_two)
    for where, run in resumed.items():
        for got, want in zip(run["results"], straight[2:], strict=True):
            assert (got[0], got[3], got[4]) == (want[0], want[3], want[4]), where
            assert got[1] == pytest.approx(want[1], rel=RTOL), f"{where}: the loss of step {want[0]} differs"
            assert got[2] == pytest.approx(want[2], rel=RTOL), f"{where}: the norm of step {want[0]} differs"
        assert _rel(run["master"], straight_master) <= RTOL, f"{where}: the final weights differ"
    assert all(row[2] > RESHARD_CASE.max_grad_norm for row in straight)  # every step clips


@pytest.mark.slow
def test_checkpoints_of_the_older_layouts_resume(tmp_path: Path) -> None:
    """A checkpoint of one process as the code before the manifest format wrote it (one file per array)
    and one of 2 ranks (a manifest over rank folders), each written byte for byte by
    legacy_checkpoint_layouts.py from the arrays of a run's step 2, resume on 2 ranks and on one process
    and continue with the uninterrupted run's losses, gradient norms and final weights. What the 2 ranks
    restored, saved again by them and read back by one process, is the arrays written, bit for bit."""
    from legacy_checkpoint_layouts import write_data_parallel, write_single

    straight_master, straight = _reshard_straight()
    saved = tmp_path / "now" / "step-00000002"
    assert _reshard_save(None, tmp_path / "now") == straight[:2]
    numels = [unit.layout.numel for unit in _model(RESHARD_CASE).units]
    state = load_checkpoint(saved, {})
    arrays = {
        name: torch.empty(info["numel"], dtype=getattr(torch, info["dtype"])) for name, info in state["arrays"].items()
    }
    load_checkpoint(saved, arrays)
    legacy = {
        "legacy-one": write_single(tmp_path / "one" / "step-00000002", 2, arrays, state["extra"]),
        "legacy-two": write_data_parallel(tmp_path / "two" / "step-00000002", 2, arrays, state["extra"], numels, 2),
    }
    spec = {
        "reshard_resume": {name: str(path) for name, path in legacy.items()},
        "resave": str(tmp_path / "resaved"),
        "timeout_s": 30.0,
    }
    for rank, (code, err) in enumerate(wait_ranks(_launch(2, spec, tmp_path / "b"), LAUNCH_TIMEOUT_S)):
        assert code == 0, f"rank {rank} of 2 failed:\n{err[-3000:]}"
    resumed = {
        f"{name} on 2 ranks, rank {rank}": run
        for rank in range(2)
        for name, run in torch.load(tmp_path / "b" / f"resharded-rank{rank}.pt").items()
    }
    resumed.update({f"{name} on one process": _reshard_resume(None, path) for name, path in legacy.items()})
    for where, run in resumed.items():
        for got, want in zip(run["results"], straight[2:], strict=True):
            assert (got[0], got[3], got[4]) == (want[0], want[3], want[4]), where
            assert got[1] == pytest.approx(want[1], rel=RTOL), f"{where}: the loss of step {want[0]} differs"
            assert got[2] == pytest.approx(want[2], rel=RTOL), f"{where}: the norm of step {want[0]} differs"
        assert _rel(run["master"], straight_master) <= RTOL, f"{where}: the final weights differ"
    for name in legacy:  # saved at 1 (or 2), loaded at 2, saved at 2, loaded at 1
        back = {key: torch.empty_like(array) for key, array in arrays.items()}
        load_checkpoint(tmp_path / "resaved" / name / "step-00000002", back)
        assert all(torch.equal(back[key].view(torch.uint8), array.view(torch.uint8)) for key, array in arrays.items())
    one = resumed["legacy-one on one process"]  # one process, one process's checkpoint: bit for bit
    assert one["results"] == straight[2:] and torch.equal(one["master"], straight_master)


def _reshard_straight() -> tuple[torch.Tensor, list[tuple]]:
    """The uninterrupted resharding run in this process: its final master and its 4 steps."""
    with CPUDevice() as device, HostRamTier() as tier:
        engine, host = _reshard_engine(device, tier, None)
        with engine:
            rows = [_as_row(engine.step(micro, lr=LR)) for micro in _reshard_batches(0, 1)]
        return host.slab.clone(), rows


@pytest.mark.slow
def test_a_killed_rank_stops_the_others(tmp_path: Path) -> None:
    """Note [Collective failures]: rank 1 dies after its first step; ranks 0 and 2 stop within the
    collective timeout, each with a line that names it."""
    spec = {"cases": ["plain"], "timeout_s": 30.0, "kill_rank": 1}
    finished = wait_ranks(_launch(3, spec, tmp_path), LAUNCH_TIMEOUT_S)
    assert time.time() - float((tmp_path / "died-at").read_text()) < 60.0
    assert finished[1][0] == -signal.SIGKILL
    for rank in (0, 2):
        code, err = finished[rank]
        assert code != 0, f"rank {rank} went on without rank 1"
        assert f"rank {rank} of 3: " in err, err[-2000:]


def test_shards_tile_every_unit() -> None:
    for numel in (1, 7, 64, 3136, 7360):
        for world_size in (1, 2, 3, 5, 8):
            spans = [shard_span(numel, rank, world_size) for rank in range(world_size)]
            assert spans[0][0] == 0 and spans[-1][1] == numel
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            sizes = [hi - lo for lo, hi in spans]
            assert max(sizes) == -(-numel // world_size)


def test_one_process_opens_nothing() -> None:
    group = ProcessGroupContext.from_env("cpu", environ={})
    assert not group.is_distributed
    with group:
        assert group.is_open and not torch.distributed.is_initialized()
    assert not group.is_open


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, "MASTER_PORT is not set"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE must be an integer"),
        ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "rank 2"),
    ],
)
def test_a_bad_environment_is_named(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProcessGroupContext.from_env("cpu", environ=environ)


def test_an_unopened_group_is_refused() -> None:
    model = ToyModel(ToyConfig())
    group = ProcessGroupContext(0, 2)
    with CPUDevice() as device:
        host = HostParameters(model)
        with pytest.raises(ValueError, match="open the process group first"):
            Engine(model, device, host, TorchAdamW(AdamWConfig()), EngineConfig(), process_group=group)


if __name__ == "__main__":
    _rank_main(json.loads(Path(sys.argv[1]).read_text()))
