"""Placement that closes the loop (slide_hf/replacement.py): the units a run may move are chosen and priced by
the plan, the planner re-places them from measured rates, the loop moves them only on a drift and a gain,
says what moved in one line, and a run that moves units mid-run ends where the all-host run does, bit for
bit, on the CPU device."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.optim.compact_adamw import CompactAdamW
from slide_core.testing import ToyConfig, ToyModel, load_init, toy_batches, toy_init
from slide_hf.planner import Bandwidths, ModelShape, PlanInputs, make_plan, plan_with_placement
from slide_hf.planner.plan import GPU_MARGIN_FRACTION, replan_streamed, with_streamable
from slide_hf.planner.unit_costs import unit_costs
from slide_hf.replacement import MeasuredRates, Replacement, _with_rates, compact_units

GiB = 1 << 30
BLOCKS = tuple(f"layers.{i}" for i in range(6))
HOST_BOUND = Bandwidths(cpu_adam_gparams=0.01, host_mem_gbps=1.0, h2d_gbps=50.0, d2h_gbps=50.0, gpu_tflops=1000.0)
"""A host optimizer a hundred times slower than its PCIe: streaming pays."""
MIXED = dataclasses.replace(HOST_BOUND, cpu_adam_gparams=2.0, host_mem_gbps=100.0)
"""A host optimizer whose best placement streams some units and keeps the others."""
FAST_HOST = dataclasses.replace(HOST_BOUND, cpu_adam_gparams=1000.0, host_mem_gbps=10000.0)
"""The same machine whose host optimizer is never the bottleneck: streaming only costs PCIe."""


def _toy() -> ToyModel:
    return ToyModel(ToyConfig(vocab_size=4096, hidden_size=256, num_heads=4, intermediate_size=768, num_layers=6))


def _inputs(model=None, **changes) -> PlanInputs:
    values = {"batch_size": 1, "seq_len": 64, "gpu_memory_bytes": 8 * GiB, "bandwidths": HOST_BOUND, **changes}
    return PlanInputs(model or ModelShape.of(_toy()), **values)  # a shape: no resident units


def _busy(bandwidths: Bandwidths) -> float:
    return bandwidths.cpu_adam_busy_rate("fp32", "fp32")


# ---- the plan: what a run may move, and its price ------------------------------------------------------
def test_auto_leaves_the_run_room_to_move_units_within_the_staging_it_prices():
    """A plan that streams blocks lets the run move every unit whose staging fits the blocks' (the other
    blocks); the staging price stays the streamed blocks' and the step is unchanged."""
    inputs = _inputs(bandwidths=MIXED)
    fixed = plan_with_placement(inputs, "auto")
    movable = plan_with_placement(inputs, "auto", replaceable=True)
    assert fixed.inputs.streamable_units == ()
    streamed = set(movable.inputs.streamed_units)
    assert streamed and movable.inputs.streamable_units
    costs = {c.name: c.stream_device_bytes for c in unit_costs(movable.shape, movable.inputs)}
    staged = max(costs[name] for name in streamed)
    assert set(movable.inputs.streamable_units) == {
        name for name, held in costs.items() if held <= staged and name not in streamed
    } - set(movable.inputs.resident_units)
    assert movable.gpu_breakdown["streamed_staging"] == fixed.gpu_breakdown["streamed_staging"] == staged
    assert movable.step_time_s == fixed.step_time_s
    config = movable.inputs.engine_config()
    assert config.streamable_units == movable.inputs.streamable_units


def test_a_plan_that_streams_nothing_reserves_a_blocks_staging_in_spare_memory():
    """A fast host streams nothing, but the spare GPU memory holds a block's staging: the run may move the
    blocks once its steps show the host slower than planned, and the plan prices that staging."""
    inputs = _inputs(bandwidths=FAST_HOST)
    plan = plan_with_placement(inputs, "auto", replaceable=True)
    assert plan.inputs.streamed_units == ()
    assert set(BLOCKS) <= set(plan.inputs.streamable_units)
    block = next(c.stream_device_bytes for c in unit_costs(plan.shape, plan.inputs) if c.name == "layers.0")
    assert plan.gpu_breakdown["streamed_staging"] == block
    assert plan.gpu_peak_bytes <= inputs.gpu_memory_bytes
    base = make_plan(dataclasses.replace(plan.inputs, streamable_units=()))
    budget = int((base.gpu_peak_bytes + GiB + block // 2) / (1 - GPU_MARGIN_FRACTION))  # half a block spare
    tight = make_plan(dataclasses.replace(inputs, gpu_memory_bytes=budget))
    assert with_streamable(tight).inputs.streamable_units == ()  # no room: nothing to move


@pytest.mark.parametrize("change", [{"accelerator": False}, {"gpu_memory_bytes": None}])
def test_nothing_moves_on_the_cpu_device_or_without_a_gpu_budget(change):
    assert plan_with_placement(_inputs(**change), "auto", replaceable=True).inputs.streamable_units == ()


def test_the_planner_replaces_the_units_from_measured_rates():
    """One owner of the decision: ``replan_streamed`` is ``auto``'s placement at other rates, among the
    units the run can move."""
    planned = plan_with_placement(_inputs(bandwidths=FAST_HOST), "auto", replaceable=True)
    slow_host = replan_streamed(planned, HOST_BOUND)
    assert slow_host.inputs.streamed_units
    assert set(slow_host.inputs.streamed_units) <= set(planned.inputs.streamable_units)
    kept = make_plan(dataclasses.replace(planned.inputs, bandwidths=HOST_BOUND))
    assert slow_host.step_time_s < kept.step_time_s
    assert replan_streamed(planned, FAST_HOST).inputs.streamed_units == ()


def test_a_slower_pcie_measured_in_steps_streams_fewer_units():
    """The streamed copies' PCIe rate measured in the run is one of the planner's inputs: a link slower
    under load than the doctor measured makes streaming dearer, so the same decision streams fewer units."""
    planned = plan_with_placement(_inputs(bandwidths=MIXED), "auto", replaceable=True)
    streamed = set(planned.inputs.streamed_units)
    assert streamed
    chosen_with = MeasuredRates(_busy(MIXED), MIXED.gpu_tflops, MIXED.h2d_gbps, MIXED.d2h_gbps)
    assert set(replan_streamed(planned, _with_rates(planned.inputs, chosen_with)).inputs.streamed_units) == streamed
    slow_link = dataclasses.replace(chosen_with, h2d_gbps=MIXED.h2d_gbps / 4, d2h_gbps=MIXED.d2h_gbps / 4)
    bandwidths = _with_rates(planned.inputs, slow_link)
    assert (bandwidths.h2d_gbps, bandwidths.d2h_gbps) == (MIXED.h2d_gbps / 4, MIXED.d2h_gbps / 4)
    fewer = set(replan_streamed(planned, bandwidths).inputs.streamed_units)
    assert fewer < streamed
    # A faster measured link is not laid over the plan's: spans under load never time the link alone.
    fast_link = dataclasses.replace(chosen_with, h2d_gbps=4 * MIXED.h2d_gbps)
    assert _with_rates(planned.inputs, fast_link).h2d_gbps == MIXED.h2d_gbps


def test_the_loop_moves_units_to_the_host_when_the_measured_pcie_is_slow():
    planned = plan_with_placement(_inputs(bandwidths=MIXED), "auto", replaceable=True)
    rates = _Rates(_busy(MIXED), MIXED.gpu_tflops, h2d=MIXED.h2d_gbps / 4, d2h=MIXED.d2h_gbps / 4)
    loop = Replacement(planned, warmup_steps=0, check_every=1, rates=rates)
    assert loop.chosen_with.h2d_gbps == MIXED.h2d_gbps  # the plan's rates until a check
    change = loop.after_step(1, {}, _Engine())
    assert change is not None and change.to_host and not change.to_gpu
    assert change.rates.h2d_gbps == MIXED.h2d_gbps / 4
    assert change.to_dict()["measured"]["d2h_gbps"] == MIXED.d2h_gbps / 4


# ---- the loop ------------------------------------------------------------------------------------------
class _Engine:
    """Records the moves a loop makes."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, ...]] = []

    def place_streamed(self, names: Sequence[str]) -> tuple[frozenset[str], frozenset[str]]:
        self.moves.append(tuple(names))
        return frozenset(), frozenset()


class _Rates:
    """An injected rates source: the host AdamW's busy rate the test says."""

    def __init__(self, host: float, gpu: float, h2d: float | None = None, d2h: float | None = None) -> None:
        self.host, self.gpu, self.h2d, self.d2h = host, gpu, h2d, d2h

    def __call__(self, meter) -> MeasuredRates:
        return MeasuredRates(self.host, self.gpu, self.h2d, self.d2h)


def test_the_loop_moves_units_on_a_drift_and_says_why(caplog: pytest.LogCaptureFixture):
    planned = plan_with_placement(_inputs(bandwidths=FAST_HOST), "auto", replaceable=True)
    rates = _Rates(_busy(FAST_HOST), FAST_HOST.gpu_tflops)
    loop = Replacement(planned, warmup_steps=1, check_every=2, rates=rates)
    engine = _Engine()
    moves = []
    for step in range(1, 4):  # warm-up, then one check at the plan's rates: nothing moves
        moves.append(loop.after_step(step, {}, engine))
    assert moves == [None] * 3 and engine.moves == []
    rates.host = _busy(HOST_BOUND)  # the host is a hundred times slower than planned
    with caplog.at_level(logging.INFO, logger="slide.replacement"):
        changes = [loop.after_step(step, {}, engine) for step in (4, 5)]
    change = changes[1]
    assert changes[0] is None and change is not None
    assert engine.moves == [change.streamed] and loop.streamed == change.streamed
    assert change.to_gpu == change.streamed and not change.to_host and change.step == 5
    assert change.host_s > change.streamed_s and change.planned_s[1] < change.planned_s[0]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"placement after step 5: units {compact_units(change.streamed, loop.order)} now updated")
    assert "on the GPU (host AdamW " in line and " > GPU-streamed " in line and "measured" in line
    # The first step after a move is not measured; the same rates again are no drift: nothing moves.
    assert [loop.after_step(step, {}, engine) for step in (6, 7, 8)] == [None] * 3
    rates.host = _busy(FAST_HOST)
    back = [loop.after_step(step, {}, engine) for step in (9, 10)][1]
    assert back is not None and back.to_host == change.streamed and back.streamed == ()
    assert loop.check_every == 4  # back where the first move started: the loop checks half as often
    assert " now updated on the host (GPU-streamed " in back.line()


def test_a_small_drift_or_a_small_gain_moves_nothing():
    """Hysteresis: within ``drift`` of the rates of the last decision, the planner is not asked; past it, a
    placement that gains less than ``min_gain`` is not taken."""
    planned = plan_with_placement(_inputs(bandwidths=FAST_HOST), "auto", replaceable=True)
    rates = _Rates(_busy(FAST_HOST) * 0.95, FAST_HOST.gpu_tflops)
    loop = Replacement(planned, warmup_steps=0, check_every=1, rates=rates)
    engine = _Engine()
    assert loop.after_step(1, {}, engine) is None
    assert loop.chosen_with.host_adam_gparams == _busy(FAST_HOST)  # no drift: the planner was not asked
    rates.host = _busy(HOST_BOUND)
    greedy = Replacement(planned, warmup_steps=0, check_every=1, rates=rates, min_gain=0.999)
    assert greedy.after_step(1, {}, engine) is None and engine.moves == []
    assert greedy.chosen_with.host_adam_gparams == _busy(HOST_BOUND)  # decided, so the next check needs a drift


def test_compact_units_writes_runs_as_ranges():
    order = ("embed", *(f"block.{i}" for i in range(12)), "head")
    assert compact_units(["block.9", "block.3", "block.4", "block.5"], order) == "block.3-5, block.9"
    assert compact_units(["head", "embed", "block.0", "block.1"], order) == "embed, block.0-1, head"
    assert compact_units([], order) == "none"


# ---- a run that moves units ----------------------------------------------------------------------------
@pytest.mark.parametrize(("state_format", "max_grad_norm"), [("fp32", 0.0), ("int8", 0.0), ("bf16", 0.05)])
def test_a_run_moved_by_the_loop_ends_with_the_all_host_bits(state_format: str, max_grad_norm: float):
    """The loop, fed injected rates, moves the blocks to the GPU-streamed update and back in a real engine
    on the CPU device (the streamable units as the plan of its shape chose them); masters and moments end equal bit for
    bit to the all-host run's, with and without clipping."""
    cfg = ToyConfig(tie_embeddings=False, num_layers=4, hidden_size=64, intermediate_size=128)
    model = ToyModel(cfg)
    init = toy_init(model, seed=3)
    batches = toy_batches(cfg, steps=7, accum=1, seed=6)
    adam = AdamWConfig(weight_decay=0.1, state_format=state_format)
    planned = plan_with_placement(
        _inputs(ModelShape.of(model), bandwidths=FAST_HOST, optimizer_state=state_format, compute_dtype_bytes=4),
        "auto",
        replaceable=True,
    )
    assert planned.inputs.streamable_units
    rates = _Rates(_busy(FAST_HOST), FAST_HOST.gpu_tflops)

    def run(streamable: tuple[str, ...]):
        config = EngineConfig(
            compute_dtype=torch.float32, transfer_chunk_numel=4096, max_grad_norm=max_grad_norm,
            streamable_units=streamable,
        )  # fmt: skip
        optimizer = TorchAdamW(adam) if state_format == "fp32" else CompactAdamW(adam, fused=False)
        loop = Replacement(planned, warmup_steps=0, check_every=2, rates=rates)
        placements = []
        with CPUDevice() as device:
            host = HostParameters(model, device.alloc_pinned)
            load_init(host, init)
            with Engine(model, device, host, optimizer, config) as engine:
                for step, micro in enumerate(batches, start=1):
                    engine.step(micro, lr=3e-3)
                    placements.append(engine.streamed_units)
                    rates.host = _busy(HOST_BOUND) if step < 4 else _busy(FAST_HOST)
                    if streamable:
                        loop.after_step(step, engine.unit_times(), engine)
                engine.drain(with_state=True)
                state = {u.name: {k: v.clone() for k, v in engine.host_state.views(u).items()} for u in model.units}
            planes = {name: plane.clone() for name, plane in host.planes.items()}
        return planes, state, placements, loop.changes

    host_planes, host_state, _, _ = run(())
    rates.host = _busy(FAST_HOST)
    planes, state, placements, changes = run(planned.inputs.streamable_units)
    assert [bool(change.to_gpu) for change in changes] == [True, False]  # to the GPU, then back to the host
    assert placements[0] == () and any(placements) and placements[-1] == ()
    for name, plane in host_planes.items():
        assert torch.equal(planes[name], plane), name
    for unit, arrays in host_state.items():
        for name, tensor in arrays.items():
            assert torch.equal(state[unit][name].view(torch.uint8), tensor.view(torch.uint8)), (unit, name)


# ---- the commands --------------------------------------------------------------------------------------
def _force_a_move(module, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU device (whose plan moves nothing): let ``module``'s placement move the blocks, and have
    the steps measure a host AdamW at a thousand parameters a second, so the first check moves them."""
    from slide_hf import replacement

    placing = module.place_units

    def placed(model, device, options, **kwargs):
        placement = placing(model, device, options, **kwargs)
        inputs = placement.plan.inputs
        plan = make_plan(dataclasses.replace(inputs, streamable_units=tuple(inputs.shape.block_names)))
        return dataclasses.replace(placement, plan=plan)

    monkeypatch.setattr(module, "place_units", placed)
    monkeypatch.setattr(replacement, "measured_rates", lambda meter: MeasuredRates(1e-6, None))


def test_bench_json_shows_the_placement_each_step_ran(slide, monkeypatch, tmp_path) -> None:
    from slide_hf import bench

    _force_a_move(bench, monkeypatch)
    argv = ("--model", "test-llama", "--batch-size", "2", "--seq-len", "16", "--steps", "13", "--warmup", "1")
    status, out, err = slide("bench", *argv)
    assert status == 0, err
    result = json.loads(out)
    engine = result.get("slide", result)
    per_step = engine["streamed_units_per_step"]
    (change,) = engine["placement_changes"]
    assert change["step"] == 11 and change["to_gpu"] and not change["to_host"]
    assert per_step[:11] == ["none"] * 11 and per_step[11:] == [change["streamed_units"]] * 2


def test_train_metrics_carry_the_placement_when_it_changes(slide, monkeypatch, tmp_path, caplog) -> None:
    from slide_hf import recipe

    _force_a_move(recipe, monkeypatch)
    metrics = tmp_path / "metrics.jsonl"
    argv = ("--device", "cpu", "--dtype", "float32", "--steps", "13", "--seq-len", "32", "--batch-size", "2")
    with caplog.at_level(logging.INFO, logger="slide.replacement"):
        status, _, err = slide("train", "--output", tmp_path / "run", "--metrics", metrics, *argv)
    assert status == 0, err
    records = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]
    named = {record["step"]: record["streamed_units"] for record in records if "streamed_units" in record}
    assert list(named) == [1, 12] and named[1] == "none" and named[12] != "none"
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("placement after step 11")]
    assert f"units {named[12]} now updated on the GPU (host AdamW " in line


# ---- data parallel: rank 0 decides for every rank --------------------------------------------------------
class _Ranks:
    """Two ranks' ``broadcast_object`` played in one process: rank 0's value, handed to rank 1 in turn."""

    def __init__(self, rank: int, wire: list) -> None:
        self.rank, self._wire = rank, wire

    def broadcast_object(self, value, what: str):
        if self.rank == 0:
            self._wire.append(value)
            return value
        return self._wire.pop(0)


def test_every_rank_takes_rank_0s_decision():
    """Note [Ranks place alike]: rank 1's steps measure a host that streaming would not help, rank 0's one a
    hundred times slower than planned; both ranks move the units rank 0's rates call for, after the same
    step, and both keep rank 0's rates for the next check's hysteresis."""
    planned = plan_with_placement(_inputs(bandwidths=FAST_HOST), "auto", replaceable=True)
    wire: list = []
    rates = [_Rates(_busy(HOST_BOUND), FAST_HOST.gpu_tflops), _Rates(_busy(FAST_HOST), FAST_HOST.gpu_tflops)]
    loops = [Replacement(planned, warmup_steps=0, check_every=2, rates=rates[r], ranks=_Ranks(r, wire)) for r in (0, 1)]
    engines = [_Engine(), _Engine()]
    for step in (1, 2):
        changes = [loop.after_step(step, {}, engine) for loop, engine in zip(loops, engines, strict=True)]
    assert changes[0] is not None and changes[0] == changes[1] and not wire
    assert engines[0].moves == engines[1].moves == [changes[0].streamed]
    assert loops[1].chosen_with == loops[0].chosen_with == changes[0].rates
    alone = Replacement(planned, warmup_steps=0, check_every=2, rates=rates[1])
    assert [alone.after_step(step, {}, _Engine()) for step in (1, 2)] == [None, None]  # rank 1's own rates: no move


_MOVING_RANK = """
import json, sys
from slide_core.engine import Engine
from slide_hf import recipe, replacement
from slide_hf.cli.main import main
from slide_hf.planner import make_plan
from slide_hf.replacement import MeasuredRates
import dataclasses, os

record, argv = sys.argv[1], sys.argv[2:]
rank = int(os.environ["RANK"])
placing, stepping = recipe.place_units, Engine.step
placed_per_step = []

def placed(model, device, options, **kwargs):  # the CPU device's plan moves nothing: let the blocks move
    placement = placing(model, device, options, **kwargs)
    inputs = placement.plan.inputs
    plan = make_plan(dataclasses.replace(inputs, streamable_units=tuple(inputs.shape.block_names)))
    return dataclasses.replace(placement, plan=plan)

def step(engine, *args, **kwargs):
    result = stepping(engine, *args, **kwargs)
    placed_per_step.append(list(engine.streamed_units))
    return result

recipe.place_units, Engine.step = placed, step
# rank 0's steps measure a host AdamW at a thousand parameters a second (move the blocks to the GPU); the
# other rank's, one that streaming would not help: every rank must still make rank 0's move
slow = MeasuredRates(1e-6, None) if rank == 0 else MeasuredRates(1e6, None)
replacement.measured_rates = lambda meter: slow
status = main(argv)
with open(os.path.join(record, f"rank{rank}.json"), "w") as out:
    json.dump(placed_per_step, out)
sys.exit(status)
"""


@pytest.mark.slow
def test_gloo_ranks_of_slide_train_move_the_same_units_after_the_same_step(tmp_path) -> None:
    """Two gloo ranks of `slide train` whose steps measure different host rates: rank 0's check moves the
    blocks after step 11 and every rank's engine updates the same units from step 12 on."""
    import subprocess
    import sys

    from slide_core.testing import launch_ranks, wait_ranks

    record = tmp_path / "ranks"
    record.mkdir()
    argv = ("train", "--device", "cpu", "--dtype", "float32", "--steps", "13",
            "--seq-len", "32", "--batch-size", "2", "--output", str(tmp_path / "run"))  # fmt: skip
    command = [sys.executable, "-c", _MOVING_RANK, str(record), *argv]
    for rank, (code, err) in enumerate(wait_ranks(launch_ranks(command, 2, stdout=subprocess.DEVNULL), 240.0)):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    per_rank = [json.loads((record / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert per_rank[0] == per_rank[1]
    assert per_rank[0][:11] == [[]] * 11 and per_rank[0][11] and per_rank[0][11] == per_rank[0][12]
