"""Where units are updated: the chooser on synthetic costs, and plan_with_placement's three modes."""

from __future__ import annotations

import dataclasses

import pytest

from slide_core.testing import ToyConfig, ToyModel
from slide_hf.errors import UserError
from slide_hf.planner import Bandwidths, ModelShape, PlanInputs, make_plan, plan_with_placement
from slide_hf.planner.unit_costs import RESOURCES, UnitCost, staging_price, unit_costs
from slide_hf.planner.update_placement import choose_streamed_units, step_resources

GiB = 1 << 30


def _block(name: str, *, host_s: float = 1.0, pcie_s: float = 0.25, gpu_s: float = 0.05, device_bytes: int = 10):
    """A unit whose host update takes ``host_s`` of CPU and host memory; streamed, it takes ``pcie_s`` each
    way and ``gpu_s`` of GPU time."""
    return UnitCost(
        name=name,
        numel=1000,
        host={"pcie h2d": 0.1, "pcie d2h": 0.1, "host memory": host_s, "cpu": host_s},
        streamed={"gpu compute": gpu_s, "pcie h2d": 0.1 + pcie_s, "pcie d2h": pcie_s, "host memory": 0.1},
        resident={"gpu compute": gpu_s},
        stream_device_bytes=device_bytes,
    )


def _step(fixed, units, streamed) -> float:
    return max(step_resources(fixed, units, set(streamed)).values())


def test_a_host_bound_step_moves_units_to_the_gpu_until_another_resource_binds():
    units = [_block(f"block.{i}") for i in range(8)]
    fixed = {"gpu compute": 2.0}
    streamed = choose_streamed_units(fixed, units, device_budget_bytes=100)
    # With k streamed: CPU 8 - k, host memory 8 - 0.9 k (the DMA stays), PCIe h2d 0.8 + 0.25 k, GPU 2 + 0.05 k.
    # Host memory meets PCIe at k = 6.26: 7 (PCIe 2.55) beats 6 (host memory 2.6) and 8 (PCIe 2.8).
    assert streamed == tuple(f"block.{i}" for i in range(7))
    best = _step(fixed, units, streamed)
    for count in range(9):  # the greedy's count is the best count (the step is convex in it)
        assert _step(fixed, units, [u.name for u in units[:count]]) >= best - 1e-12


def test_a_gpu_bound_step_keeps_every_unit_on_the_host():
    units = [_block(f"block.{i}") for i in range(8)]
    assert choose_streamed_units({"gpu compute": 100.0}, units, device_budget_bytes=100) == ()


def test_a_unit_is_moved_only_when_it_lowers_the_step():
    """Streaming that costs more PCIe than the host work it saves never pays."""
    units = [_block(f"block.{i}", host_s=0.1, pcie_s=5.0) for i in range(4)]
    assert choose_streamed_units({}, units, device_budget_bytes=100) == ()


def test_the_gpu_budget_bounds_the_largest_streamed_unit():
    units = [_block("embedding", device_bytes=500), *(_block(f"block.{i}", device_bytes=50) for i in range(3))]
    streamed = choose_streamed_units({}, units, device_budget_bytes=100)
    assert "embedding" not in streamed and streamed  # blocks fit, the embedding's staging does not
    assert choose_streamed_units({}, units, device_budget_bytes=49) == ()
    assert "embedding" in choose_streamed_units({}, units, device_budget_bytes=500)


def test_units_with_state_on_nvme_stay_on_the_host():
    units = [dataclasses.replace(_block(f"block.{i}"), can_stream=i % 2 == 0) for i in range(4)]
    streamed = choose_streamed_units({}, units, device_budget_bytes=100)
    assert streamed and all(int(name.split(".")[1]) % 2 == 0 for name in streamed)


# ---- plan_with_placement -----------------------------------------------------------------------------
def _toy() -> ToyModel:
    return ToyModel(ToyConfig(vocab_size=4096, hidden_size=256, num_heads=4, intermediate_size=768, num_layers=6))


HOST_BOUND = Bandwidths(cpu_adam_gparams=0.01, host_mem_gbps=1.0, h2d_gbps=50.0, d2h_gbps=50.0, gpu_tflops=1000.0)
"""A host optimizer a hundred times slower than its PCIe: streaming pays."""
GPU_BOUND = Bandwidths(gpu_tflops=0.001)


def _inputs(**changes) -> PlanInputs:
    values = {"batch_size": 1, "seq_len": 64, "gpu_memory_bytes": 8 * GiB, "bandwidths": HOST_BOUND, **changes}
    return PlanInputs(ModelShape.of(_toy()), **values)


def test_auto_streams_units_of_a_host_bound_run_and_lowers_its_step_time():
    inputs = _inputs()
    host = plan_with_placement(inputs, "host")
    auto = plan_with_placement(inputs, "auto")
    assert host.inputs.streamed_units == ()
    assert auto.inputs.streamed_units and auto.step_time_s < host.step_time_s
    assert auto.resource_s["cpu"] < host.resource_s["cpu"]
    assert auto.step_time_s == max(auto.resource_s.values())
    counts = auto.placement_counts()
    assert counts["streamed"] == auto.inputs.streamed_units
    assert len(counts["host"]) + len(counts["streamed"]) + len(counts["resident"]) == 8


def test_auto_keeps_a_gpu_bound_run_on_the_host():
    assert plan_with_placement(_inputs(bandwidths=GPU_BOUND), "auto").inputs.streamed_units == ()


@pytest.mark.parametrize("change", [{"accelerator": False}, {"gpu_memory_bytes": None}])
def test_auto_updates_on_the_host_on_the_cpu_device_or_without_a_gpu_budget(change):
    assert plan_with_placement(_inputs(**change), "auto").inputs.streamed_units == ()


def test_auto_streams_with_clipping_and_prices_the_kept_gradient():
    """Note [Streamed speculation]: with clipping a streamed unit's gradient also goes d2h once, into the
    clipping store, and its speculative update scales one transfer chunk at a time into an fp32 scratch;
    a host-bound run still streams units."""
    plain, clipping = _inputs(), _inputs(max_grad_norm=1.0)
    d2h_rate = HOST_BOUND.d2h_gbps * 1e9
    chunk = clipping.transfer_chunk_numel
    optimizer = clipping.device_optimizer()
    for without, with_clip in zip(unit_costs(plain.shape, plain), unit_costs(clipping.shape, clipping), strict=True):
        n = with_clip.numel
        kept = n * clipping.compute_dtype_bytes
        assert with_clip.streamed["pcie d2h"] == pytest.approx(without.streamed["pcie d2h"] + kept / d2h_rate)
        assert with_clip.host == without.host and with_clip.can_stream
        scratch = optimizer.device_scratch_bytes(min(n, chunk)) - optimizer.device_scratch_bytes(n)
        assert with_clip.stream_device_bytes == without.stream_device_bytes + 4 * min(n, chunk) + scratch
    host, auto = plan_with_placement(clipping, "host"), plan_with_placement(clipping, "auto")
    assert auto.inputs.streamed_units and auto.step_time_s < host.step_time_s


def test_gpu_streams_every_unit_and_prices_the_staging_sets_of_the_largest():
    plan = plan_with_placement(_inputs(bandwidths=GPU_BOUND), "gpu")
    assert len(plan.inputs.streamed_units) == 8  # a ModelShape gets no resident units
    assert plan.inputs.staging_sets == 3
    largest = max(cost.stream_device_bytes for cost in unit_costs(plan.shape, plan.inputs))
    assert plan.gpu_breakdown["streamed_staging"] == largest
    assert make_plan(_inputs()).gpu_breakdown["streamed_staging"] == 0


def test_gpu_takes_two_staging_sets_where_three_do_not_fit_and_refuses_where_two_do_not():
    """Note [Three staging sets]: the third set overlaps uploads and write-backs, but a budget that holds
    only two still streams every unit, and one that holds fewer is refused in one line."""
    roomy = plan_with_placement(_inputs(bandwidths=GPU_BOUND), "gpu")
    three = roomy.gpu_breakdown["streamed_staging"]
    two = dataclasses.replace(roomy.inputs, staging_sets=2)
    two_bytes = make_plan(two).gpu_breakdown["streamed_staging"]
    assert two_bytes < three
    tight = plan_with_placement(_inputs(bandwidths=GPU_BOUND, gpu_memory_bytes=roomy.gpu_peak_bytes - 1), "gpu")
    assert tight.inputs.staging_sets == 2
    assert tight.gpu_peak_bytes <= roomy.gpu_peak_bytes - 1
    with pytest.raises(UserError, match="to stage the streamed units"):
        plan_with_placement(_inputs(bandwidths=GPU_BOUND, gpu_memory_bytes=make_plan(two).gpu_peak_bytes - 1), "gpu")


def test_streamed_staging_is_three_sets_of_master_and_moments_as_stored():
    """A unit is named as the model names it (ToyModel: ``layers.N``); slide-hf's ``block.N`` stands for it."""
    inputs = dataclasses.replace(_inputs(optimizer_state="bf16"), streamed_units=("block.0",))
    cost = next(c for c in unit_costs(inputs.shape, inputs) if c.name == "layers.0")
    scratch = inputs.device_optimizer().device_scratch_bytes(cost.numel)
    assert cost.stream_device_bytes == 3 * (4 + 2 + 2) * cost.numel + scratch


def test_a_split_master_stages_its_planes_and_one_fp32_buffer():
    """In each set the planes (2 + 2 B and the tie bits) take the fp32 master's place; one fp32 buffer
    more holds the values an update decodes (Note [Three staging sets])."""
    inputs = _inputs(master_format="split")
    fp32 = {c.name: c.stream_device_bytes for c in unit_costs(inputs.shape, _inputs())}
    for cost in unit_costs(inputs.shape, inputs):
        ties = 3 * (-(-cost.numel // 8) + 1)
        assert cost.stream_device_bytes - fp32[cost.name] == 4 * cost.numel + ties


def test_units_with_several_gradient_contributions_stream_at_the_price_of_their_sums():
    """Note [Streamed accumulation]: with gradient accumulation every unit may stream. The contributions
    before the last cross d2h and are summed on the host, their fp32 sum goes up with the master, every load
    reads the host, and the staging lends the unit an fp32 sum while it is staged: one per set once every
    unit sums (Note [One sum per summing unit in flight]); a tied embedding with one micro-batch sums its
    two shares the same way, and is then the one unit holding a sum."""
    one, accumulating = _inputs(), _inputs(grad_accum=2)
    single = {c.name: c for c in unit_costs(one.shape, one)}
    d = one.compute_dtype_bytes
    h2d_rate, d2h_rate = HOST_BOUND.h2d_gbps * 1e9, HOST_BOUND.d2h_gbps * 1e9
    for cost in unit_costs(accumulating.shape, accumulating):
        n, alone = cost.numel, single[cost.name]
        assert cost.can_stream and cost.streamed != cost.host
        assert cost.stream_device_bytes == alone.stream_device_bytes + 4 * n  # its fp32 sum, streamed alone
        assert cost.streamed["pcie d2h"] == pytest.approx(alone.streamed["pcie d2h"] + n * d / d2h_rate)
        sum_up = alone.streamed["pcie h2d"] + 4 * n / h2d_rate  # the sum, and every load from the host
        assert cost.streamed["pcie h2d"] == pytest.approx(sum_up) or cost.streamed["pcie h2d"] > sum_up
    streamed = plan_with_placement(dataclasses.replace(accumulating, bandwidths=GPU_BOUND), "gpu")
    assert len(streamed.inputs.streamed_units) == 8
    largest = max(single.values(), key=lambda c: c.numel)
    assert streamed.gpu_breakdown["streamed_staging"] == largest.stream_device_bytes + 3 * 4 * largest.numel

    def two_blocks(*, tied: bool) -> PlanInputs:
        config = ToyConfig(vocab_size=4096, hidden_size=256, num_heads=4, num_layers=2, tie_embeddings=tied)
        return PlanInputs(ModelShape.of(ToyModel(config)), seq_len=64, gpu_memory_bytes=8 * GiB, bandwidths=HOST_BOUND)

    tied, untied = two_blocks(tied=True), two_blocks(tied=False)
    offered = {c.name for c in unit_costs(tied.shape, tied) if c.can_stream}
    assert offered == {"embed", "layers.0", "layers.1", "head"}  # the model's own names
    price = staging_price(tied.shape, tied)
    costs = {c.name: c for c in unit_costs(tied.shape, tied)}
    embed = costs["embed"].numel
    alone = {c.name: c.stream_device_bytes for c in unit_costs(untied.shape, untied)}  # no unit sums
    assert costs["embed"].stream_device_bytes == price(["embed"]) == alone["embed"] + 4 * embed
    blocks = ["layers.0", "layers.1", "head"]
    assert price(blocks) == max(costs[name].stream_device_bytes for name in blocks)  # none of them sums
    assert price(["embed", *blocks]) == price(["embed"])  # one sum, the embedding's, whatever else streams


def test_gpu_streams_with_clipping_and_is_refused_in_one_line_on_the_cpu_device_or_past_the_budget():
    clipping = plan_with_placement(_inputs(max_grad_norm=1.0, bandwidths=GPU_BOUND), "gpu")
    assert len(clipping.inputs.streamed_units) == 8
    with pytest.raises(UserError, match=r"^--update-placement gpu needs a GPU device"):
        plan_with_placement(_inputs(accelerator=False), "gpu")
    base = make_plan(_inputs()).gpu_peak_bytes
    with pytest.raises(UserError, match=r"of it to stage the streamed units\), .* in the budget; use"):
        plan_with_placement(_inputs(gpu_memory_bytes=base + 1), "gpu")


def test_host_moves_nothing_and_resident_units_are_chosen_first():
    inputs = PlanInputs(_toy(), batch_size=1, seq_len=64, gpu_memory_bytes=8 * GiB, bandwidths=HOST_BOUND)
    host = plan_with_placement(inputs, "host")
    assert host.inputs.resident_units and host.inputs.streamed_units == ()
    auto = plan_with_placement(inputs, "auto")
    assert not set(auto.inputs.resident_units) & set(auto.inputs.streamed_units)
    assert auto.step_time_s <= host.step_time_s


def test_auto_keeps_todays_residents_when_streaming_does_not_pay():
    """No GPU memory is held back for streaming that streams nothing."""
    inputs = PlanInputs(_toy(), batch_size=1, seq_len=64, gpu_memory_bytes=8 * GiB, bandwidths=GPU_BOUND)
    auto, host = plan_with_placement(inputs, "auto"), plan_with_placement(inputs, "host")
    assert auto.inputs.resident_units == host.inputs.resident_units and auto.inputs.streamed_units == ()


def test_resident_and_streamed_units_leave_the_host_resources():
    inputs = _inputs()
    every = tuple(cost.name for cost in unit_costs(inputs.shape, inputs))
    host = make_plan(inputs)
    resident = make_plan(dataclasses.replace(inputs, resident_units=every))
    streamed = make_plan(dataclasses.replace(inputs, streamed_units=every))
    assert host.resource_s["cpu"] > 0 and resident.resource_s["cpu"] == streamed.resource_s["cpu"] == 0
    assert streamed.resource_s["pcie d2h"] > resident.resource_s["pcie d2h"]  # master and moments come back
    assert set(host.resource_s) == set(RESOURCES)


def test_an_unknown_mode_is_one_line():
    with pytest.raises(UserError, match="must be one of auto, host, gpu"):
        plan_with_placement(_inputs(), "device")


# ---- the option ------------------------------------------------------------------------------------------
def test_the_option_defaults_to_host_and_refuses_other_names():
    from slide_hf.options import MACHINE_OPTIONS, TrainConfig

    assert TrainConfig().update_placement == "host"
    assert TrainConfig(update_placement="auto").update_placement == "auto"
    assert TrainConfig(update_placement="gpu").update_placement == "gpu"
    with pytest.raises(UserError, match=r"^--update-placement must be one of auto, host, gpu, got 'cpu'$"):
        TrainConfig(update_placement="cpu")
    assert "update_placement" in MACHINE_OPTIONS  # where updates run, not what they compute: a resume may change it


def test_every_placement_takes_clipping():
    from slide_hf.options import TrainConfig

    for placement in ("auto", "host", "gpu"):  # streamed units speculate with clipping on
        assert TrainConfig(update_placement=placement, max_grad_norm=1.0).max_grad_norm == 1.0


def test_train_and_bench_take_the_option_with_clipping_and_refuse_gpu_on_the_cpu_device(slide, tmp_path):
    status, _, err = slide("train", "--update-placement", "gpu", "--max-grad-norm", "1", "--output", tmp_path / "r")
    assert status == 2 and err.count("\n") == 1 and "--update-placement gpu needs a GPU device" in err
    status, _, err = slide("bench", "--update-placement", "gpu", "--max-grad-norm", "1")
    assert status == 2 and "--update-placement gpu needs a GPU device" in err


def test_a_run_on_the_cpu_device_places_no_streamed_unit():
    """auto is host on the CPU device (no PCIe to relieve): what the engine is given is today's placement."""
    from slide_core.devices.cpu import CPUDevice
    from slide_hf.options import TrainConfig
    from slide_hf.setup import RunOptions, place_units

    def options(placement: str) -> RunOptions:
        return RunOptions.from_config(TrainConfig(device="cpu", batch_size=1, seq_len=64, update_placement=placement))

    placement = place_units(_toy(), CPUDevice(), options("auto"))
    assert placement.streamed == () and placement.plan.inputs.streamed_units == ()
    with pytest.raises(UserError, match="needs a GPU device"):
        place_units(_toy(), CPUDevice(), options("gpu"))


# ---- slide bench: measured against predicted ---------------------------------------------------------------
def test_bench_sets_each_measured_bound_beside_the_plans_resource():
    from slide_hf.bench import measured_against_predicted

    resources = {"gpu compute": 0.5, "pcie h2d": 0.2, "pcie d2h": 0.4, "host memory": 0.3, "cpu": 0.6, "nvme": 0.0}
    rows = measured_against_predicted(resources, 0.6, {"gpu compute": 600.0, "pcie": 200.0}, 0.9)
    assert rows["step"] == {"measured_s": 0.9, "predicted_s": 0.6, "ratio": 1.5}
    assert rows["gpu compute"] == {"measured_s": 0.6, "predicted_s": 0.5, "ratio": 1.2}
    assert rows["pcie"] == {"measured_s": 0.2, "predicted_s": 0.4, "ratio": 0.5}  # the larger direction
    assert "host optimizer" not in rows  # not measured, not reported
    rows = measured_against_predicted({**resources, "cpu": 0.0, "host memory": 0.0}, 0.6, {"host optimizer": 5.0}, 1)
    assert rows["host optimizer"]["ratio"] is None
