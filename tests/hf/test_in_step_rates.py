"""Plans that learn the machine: a run's steps measure each term, the rates go to this machine's cache, and the
next plan here predicts what the steps measured (slide_hf/in_step_rates.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import defaultdict

import pytest

from slide_core.engine.timeline import Timeline, UnitTimes
from slide_core.testing import ToyConfig, ToyModel
from slide_hf.in_step_rates import InStepMeter, InStepRates, learn_rates, learned_inputs, workload_key
from slide_hf.machine_rates import HostIdentity
from slide_hf.planner import Bandwidths, ModelShape, PlanInputs, make_plan

HERE = HostIdentity("host-a", "cpu-a", "gpu-a")
OTHER = HostIdentity("host-b", "cpu-a", "gpu-a")


@pytest.fixture
def environ(tmp_path):
    return {"XDG_CACHE_HOME": str(tmp_path / "cache")}


def _inputs(**changes) -> PlanInputs:
    model = ToyModel(ToyConfig(vocab_size=8192, hidden_size=512, num_heads=8, intermediate_size=1536, num_layers=4))
    base = dict(
        batch_size=4,
        seq_len=256,
        accelerator=True,
        bandwidths=Bandwidths(cpu_adam_gparams=3.0, gpu_tflops=400.0, h2d_gbps=50.0, d2h_gbps=50.0),
    )
    return PlanInputs(ModelShape.of(model), **{**base, **changes})


def _times(plan, *, busy_gparams: float, tflops: float, extra: dict[str, float] | None = None) -> dict[str, UnitTimes]:
    """One step's spans as a machine with these true rates would time them: each host-updated unit's update
    at ``busy_gparams``, the compute spread over the units so that it sums to the plan's FLOPs at ``tflops``."""
    layout = plan.inputs.layout()
    times: dict[str, UnitTimes] = defaultdict(UnitTimes)
    for name in layout.host_optimized:
        times[name].ms["update"] = layout.numel[name] / (busy_gparams * 1e9) * 1e3
    compute_ms = plan.flops_per_step / (tflops * 1e12) * 1e3
    names = layout.names
    for name in names:
        times[name].ms["forward"] = compute_ms / len(names) / 4
        times[name].ms["backward"] = compute_ms / len(names) * 3 / 4
    for name, ms in (extra or {}).items():
        times[name].ms["update"] += ms
    return dict(times)


def test_the_meter_measures_the_host_adamw_busy_rate_and_the_gpu_rate_after_the_warmup():
    plan = make_plan(_inputs())
    meter = InStepMeter(plan, warmup_steps=1)
    # The first step compiles and fills caches: ten times slower, and not counted.
    meter.add(_times(plan, busy_gparams=0.2, tflops=40.0))
    for _ in range(3):
        meter.add(_times(plan, busy_gparams=2.0, tflops=250.0))
    rates = meter.rates(HERE)
    assert rates is not None
    assert rates.cpu_adam_busy_gparams == {"fp32/fp32": pytest.approx(2.0)}
    assert rates.gpu_tflops == {workload_key(plan.inputs): pytest.approx(250.0)}
    terms = meter.terms()
    assert terms.host_update_s / terms.planned_host_update_s == pytest.approx(3.0 * 0.68 / 2.0)
    assert terms.gpu_compute_s / terms.planned_gpu_compute_s == pytest.approx(400.0 / 250.0)
    assert "GPU compute" in terms.line() and "host AdamW busy" in terms.line()


def test_the_meter_leaves_out_units_whose_update_span_times_more_than_the_adamw():
    """An accumulating unit's span sums its micro-batches' gradients too: with --grad-accum every sliding unit
    accumulates, so none times the AdamW alone and no busy rate is learned."""
    plan = make_plan(_inputs(grad_accum=2))
    meter = InStepMeter(plan, warmup_steps=0)
    meter.add(_times(plan, busy_gparams=2.0, tflops=250.0))
    rates = meter.rates(HERE)
    assert rates is not None and rates.cpu_adam_busy_gparams == {}
    # Units on the state tier read their state from disk inside the span: left out too.
    plan = make_plan(_inputs(offload_optimizer="nvme", nvme_fraction=1.0))
    meter = InStepMeter(plan, warmup_steps=0)
    slow_tier = {name: 1e3 for name in plan.inputs.offloaded_units}
    meter.add(_times(plan, busy_gparams=2.0, tflops=250.0, extra=slow_tier))
    assert plan.inputs.offloaded_units
    rates = meter.rates(HERE)
    assert rates is not None  # the GPU's rate at least
    # Only units whose state is in the host slabs count: their rate, not one the disk's seconds slowed.
    assert rates.cpu_adam_busy_gparams.get("fp32/fp32", 2.0) == pytest.approx(2.0)


def test_the_next_plan_here_predicts_what_the_steps_measured(environ):
    """The whole loop: a plan from stand-alone rates, steps on a machine whose in-step rates differ, the rates
    kept, and the next plan's terms equal to the measured ones (and its step time moves with them)."""
    first = make_plan(_inputs())
    meter = InStepMeter(first, warmup_steps=1)
    for _ in range(4):
        meter.add(_times(first, busy_gparams=1.1, tflops=260.0))
    path = learn_rates(meter, environ)  # this host's identity
    assert path is not None and path.parent == InStepRates.path(HERE, environ).parent
    here = HostIdentity.here()
    inputs, taken = learned_inputs(_inputs(), here, environ)
    assert taken is not None and "host AdamW" in taken and "GPU" in taken
    second = make_plan(inputs)
    again = InStepMeter(second, warmup_steps=1)
    for _ in range(4):
        again.add(_times(second, busy_gparams=1.1, tflops=260.0))
    terms = again.terms()
    assert terms.host_update_s == pytest.approx(terms.planned_host_update_s)
    assert terms.gpu_compute_s == pytest.approx(terms.planned_gpu_compute_s)
    assert second.step_time_s > first.step_time_s  # both in-step rates are below what the first plan assumed
    # Another workload takes the host AdamW's rate (a property of the machine) but not the GPU's.
    other, taken = learned_inputs(_inputs(batch_size=8), here, environ)
    assert other.bandwidths.gpu_tflops == 400.0 and "GPU" not in taken
    assert other.bandwidths.cpu_adam_busy_rate("fp32") == pytest.approx(1.1)
    # And another machine takes nothing.
    assert learned_inputs(_inputs(), OTHER, environ) == (_inputs(), None)


def test_rates_are_kept_per_format_and_merged_with_earlier_runs(environ):
    InStepRates(HERE, "2026-12-01T00:00:00+00:00", {"fp32/fp32": 2.0, "split/bf16": 3.0}, {"w1": 100.0}).save(environ)
    InStepRates(HERE, "2026-12-02T00:00:00+00:00", {"split/bf16": 3.5}, {"w2": 200.0}).save(environ)
    kept = InStepRates.load(HERE, environ)
    assert kept.cpu_adam_busy_gparams == {"fp32/fp32": 2.0, "split/bf16": 3.5}
    assert kept.gpu_tflops == {"w1": 100.0, "w2": 200.0}
    assert kept.measured_at.startswith("2026-12-02")
    bandwidths = learned_inputs(_inputs(), HERE, environ)[0].bandwidths
    assert bandwidths.cpu_adam_busy_rate("bf16", "split") == 3.5
    assert bandwidths.cpu_adam_busy_rate("int8", "split") == pytest.approx(  # not measured: the stand-alone share
        Bandwidths(cpu_adam_gparams=3.0).cpu_adam_rate("int8", "split") * 0.68
    )


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        json.dumps({"version": 9}),
        json.dumps({"version": 1, "identity": dataclasses.asdict(HERE), "measured_at": "x"}),
        json.dumps(
            {
                "version": 1,
                "identity": dataclasses.asdict(HERE),
                "measured_at": "x",
                "cpu_adam_busy_gparams": {"fp32/fp32": float("nan")},
                "gpu_tflops": {},
            }
        ),
        json.dumps(
            {
                "version": 1,
                "identity": dataclasses.asdict(HERE),
                "measured_at": "x",
                "cpu_adam_busy_gparams": {"fp32/fp32": -1},
                "gpu_tflops": {},
            }
        ),
    ],
)
def test_a_broken_cache_is_one_line_and_plans_with_the_stand_alone_rates(environ, caplog, text):
    path = InStepRates.path(HERE, environ)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="slide.in_step_rates"):
        assert learned_inputs(_inputs(), HERE, environ) == (_inputs(), None)
    assert len(caplog.records) == 1 and "ignoring the in-step rates cache" in caplog.records[0].getMessage()
    # The next run's measurement replaces it.
    InStepRates(HERE, "now", {"fp32/fp32": 2.0}, {}).save(environ)
    assert InStepRates.load(HERE, environ).cpu_adam_busy_gparams == {"fp32/fp32": 2.0}


def test_a_cache_from_another_machine_is_not_used(environ, caplog):
    InStepRates(OTHER, "now", {"fp32/fp32": 2.0}, {}).save(environ)
    path = InStepRates.path(OTHER, environ)
    path.rename(InStepRates.path(HERE, environ))
    with caplog.at_level(logging.WARNING, logger="slide.in_step_rates"):
        assert InStepRates.load(HERE, environ) is None
    assert "measured on another machine" in caplog.text


def test_a_cache_that_cannot_be_written_is_one_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    plan = make_plan(_inputs())
    meter = InStepMeter(plan, warmup_steps=0)
    meter.add(_times(plan, busy_gparams=2.0, tflops=250.0))
    with caplog.at_level(logging.WARNING, logger="slide.in_step_rates"):
        assert learn_rates(meter, {"XDG_CACHE_HOME": str(blocker)}) is None
    assert "could not keep the rates" in caplog.text


def test_bench_on_the_cpu_reports_each_term_against_the_plan(slide, tmp_path):
    pytest.importorskip("transformers")
    status, out, err = slide(
        "bench", "--model", "test-llama", "--batch-size", "2", "--seq-len", "16", "--steps", "3", "--warmup", "1"
    )
    assert status == 0, err
    result = json.loads(out)
    terms = result.get("slide", result)["measured_against_planned_terms"]
    assert terms["host_update_busy_s"]["measured"] > 0 and terms["gpu_compute_s"]["measured"] > 0


def test_slide_plan_uses_the_rates_earlier_steps_measured_here_and_says_so(slide, tmp_path, monkeypatch):
    """`slide plan` on a GPU machine plans with the rates its earlier runs kept: the host AdamW's busy rate for
    these formats, and the GPU's rate for this very workload (what the run would measure again)."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = ("plan", "--model", "tiny-llama", "--seq-len", "128", "--gpu-memory", "4GiB", "--json")
    status, out, err = slide(*argv)
    assert status == 0, err
    before = json.loads(out)
    assert "measured in steps" not in before["rates_source"]
    # What a run of this workload measured: a host AdamW 4x slower than planned, a GPU 2x slower.
    from slide_hf.planner import Bandwidths as PlanBandwidths

    defaults = PlanBandwidths()
    busy = defaults.cpu_adam_busy_rate(before["optimizer_state"], before["master"]) / 4
    key = before["workload"]
    formats = f"{before['master']}/{before['optimizer_state']}"
    pcie = {"h2d": defaults.h2d_gbps / 2, "d2h": defaults.d2h_gbps / 2}  # the streamed copies' under load
    InStepRates(
        HostIdentity.here(), "2026-12-07T00:00:00+00:00", {formats: busy}, {key: defaults.gpu_tflops / 2}, pcie
    ).save()
    status, out, err = slide(*argv)
    assert status == 0, err
    after = json.loads(out)
    assert "rates measured in steps here 2026-12-07" in after["rates_source"]
    planned, learned = before["inputs"]["bandwidths"], after["inputs"]["bandwidths"]
    assert learned["gpu_tflops"] == planned["gpu_tflops"] / 2
    assert "PCIe's (h2d 12.5 GB/s, d2h 12.5 GB/s)" in after["rates_source"]
    assert (learned["h2d_gbps"], learned["d2h_gbps"]) == (planned["h2d_gbps"] / 2, planned["d2h_gbps"] / 2)
    assert learned["cpu_adam_busy_gparams"] == [[before["master"], before["optimizer_state"], busy]]
    assert after["resource_s"]["gpu compute"] > before["resource_s"]["gpu compute"]
    assert after["step_time_s"] > before["step_time_s"]


class _Event:
    """A device event that has completed at ``t_ms``."""

    def __init__(self, t_ms: float) -> None:
        self.t_ms = t_ms

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_ms(self, end: _Event) -> float:
        return end.t_ms - self.t_ms


def _streamed_step(plan, *, h2d_gbps: float, d2h_gbps: float, moved: int = 10**8) -> dict[str, UnitTimes]:
    """One step's spans with each of two streamed units' uploads and write-backs moving ``moved`` bytes at
    these rates, recorded through a :class:`Timeline` as the streamed pipeline records them."""
    timeline = Timeline(enabled=True)
    for name in ("layers.0", "layers.1"):
        timeline.device_span(name, "upload", _Event(0.0), _Event(moved / (h2d_gbps * 1e9) * 1e3), moved)
        timeline.device_span(name, "write_back", _Event(0.0), _Event(moved / (d2h_gbps * 1e9) * 1e3), moved)
    times = _times(plan, busy_gparams=2.0, tflops=250.0)
    for name, unit_times in timeline.take().items():
        times[name].ms.update(unit_times.ms)
        times[name].bytes.update(unit_times.bytes)
    return times


def test_the_meter_measures_the_streamed_copies_pcie_rate_from_their_spans():
    plan = make_plan(_inputs())
    meter = InStepMeter(plan, warmup_steps=1)
    meter.add(_streamed_step(plan, h2d_gbps=1.0, d2h_gbps=1.0))  # the warm-up: not counted
    for _ in range(3):
        meter.add(_streamed_step(plan, h2d_gbps=20.0, d2h_gbps=25.0))
    assert meter.pcie_gbps() == {"h2d": pytest.approx(20.0), "d2h": pytest.approx(25.0)}
    rates = meter.rates(HERE)
    assert rates is not None and rates.streamed_pcie_gbps == meter.pcie_gbps()
    terms = meter.terms()
    assert terms.streamed_h2d_s == pytest.approx(2e8 / 20e9)  # per step: two uploads
    assert terms.streamed_h2d_s / terms.planned_streamed_h2d_s == pytest.approx(50.0 / 20.0)
    assert terms.streamed_d2h_s / terms.planned_streamed_d2h_s == pytest.approx(50.0 / 25.0)
    assert "streamed upload" in terms.line() and "streamed write-back" in terms.line()
    assert {"streamed_h2d_s", "streamed_d2h_s"} <= set(terms.to_dict())
    # A run that streams nothing measures no PCIe rate and reports no such term.
    quiet = InStepMeter(plan, warmup_steps=0)
    quiet.add(_times(plan, busy_gparams=2.0, tflops=250.0))
    assert quiet.pcie_gbps() == {} and "streamed_h2d_s" not in quiet.terms().to_dict()


def test_learned_pcie_rates_round_trip_and_lower_the_next_plans_link(environ):
    InStepRates(HERE, "2026-12-01T00:00:00+00:00", {"fp32/fp32": 2.0}).save(environ)
    InStepRates(HERE, "2026-12-02T00:00:00+00:00", streamed_pcie_gbps={"h2d": 20.0, "d2h": 60.0}).save(environ)
    kept = InStepRates.load(HERE, environ)
    assert kept.streamed_pcie_gbps == {"h2d": 20.0, "d2h": 60.0} and kept.cpu_adam_busy_gparams == {"fp32/fp32": 2.0}
    assert InStepRates.from_json(kept.to_json()) == kept
    older = kept.to_json()
    del older["streamed_pcie_gbps"]  # a file written before PCIe was measured in steps
    assert InStepRates.from_json(older).streamed_pcie_gbps == {}
    inputs, taken = learned_inputs(_inputs(), HERE, environ)
    # The slower direction is laid over the doctor's rate; a faster one is not (a span under load cannot
    # time the link faster than alone).
    assert inputs.bandwidths.h2d_gbps == 20.0 and inputs.bandwidths.d2h_gbps == 50.0
    assert "PCIe's (h2d 20 GB/s)" in taken
    assert make_plan(inputs).step_time_s >= make_plan(_inputs()).step_time_s
