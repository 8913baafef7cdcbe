"""The run's log says what it measured against what its plan said (slide_hf/plan_check.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from slide_hf.plan_check import PlanCheck, host_peak_rss_bytes

GiB = 1 << 30
PLAN = SimpleNamespace(step_time_s=2.0, host_peak_bytes=10 * GiB, gpu_peak_bytes=20 * GiB)


def test_a_gpu_run_compares_the_steps_after_the_first_and_both_peaks() -> None:
    check = PlanCheck.of(PLAN, [9.0, 2.0, 3.0, 2.5], gpu_peak_bytes=22 * GiB)
    assert check.step_s == 2.5  # the median of the steps after the first, which compiles and warms
    terms = check.to_dict()
    assert terms["step_s"] == {"measured": 2.5, "planned": 2.0, "ratio": 1.25}
    assert terms["gpu_peak_bytes"]["ratio"] == pytest.approx(1.1)
    assert terms["host_peak_bytes"]["measured"] == check.host_peak_bytes > 0
    line = check.line()
    assert line.startswith("measured against planned: step 2.5 s / 2 s (x1.25), host peak ")
    assert "GPU peak 22.00 / 20.00 GiB (x1.10)" in line


def test_the_cpu_device_compares_its_host_peak_only() -> None:
    """Its plan has no step time of its own (the planner's rates are a GPU's) and no GPU."""
    check = PlanCheck.of(PLAN, [1.0, 1.0], gpu_peak_bytes=None)
    assert set(check.to_dict()) == {"host_peak_bytes"}
    assert "step" not in check.line() and "GPU" not in check.line()


def test_the_host_peak_is_the_processes_own() -> None:
    import psutil

    assert host_peak_rss_bytes() >= psutil.Process().memory_info().rss * 0.9


def test_slide_train_logs_measured_against_planned(slide, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    status, _, err = slide(
        "train", "--device", "cpu", "--steps", "2", "--seq-len", "32", "--output", str(tmp_path / "r")
    )
    assert status == 0, err
    planned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("plan: host peak")]
    measured = [r.getMessage() for r in caplog.records if r.getMessage().startswith("measured against planned")]
    assert len(planned) == 1 and len(measured) == 1
    assert planned[0].split()[3] in measured[0]  # the planned host peak, in GiB, is the one compared


def test_slide_train_logs_its_host_buffers_against_the_plans(slide, tmp_path, caplog) -> None:
    """The run counts what its engine allocated (Engine.host_allocations) and says it beside the plan's buffers:
    on the CPU, with clipping (the store) and accumulation (the accumulators), they agree within 1 %."""
    import re

    caplog.set_level(logging.INFO)
    argv = ("train", "--device", "cpu", "--steps", "2", "--seq-len", "32", "--output", str(tmp_path / "r"))
    status, _, err = slide(*argv, "--max-grad-norm", "1", "--grad-accum", "2")
    assert status == 0, err
    (measured,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("measured against planned")]
    found = re.search(r"host buffers ([\d.]+) / ([\d.]+) GiB \(x([\d.]+)\)", measured)
    assert found is not None, measured
    assert float(found.group(1)) > 0 and abs(float(found.group(3)) - 1.0) <= 0.01, measured


def test_steps_after_a_clipped_step_are_compared_with_the_deferred_plan() -> None:
    """With clipping firing, every step after the first waits for the norm (Note [Deferred steps]): the
    run's steps are compared with the plan for the steps they were."""
    from slide_hf.planner.plan import Plan

    plan = SimpleNamespace(
        step_time_s=2.0,
        clipped_step_time_s=3.0,
        host_peak_bytes=10 * GiB,
        gpu_peak_bytes=20 * GiB,
    )
    plan.expected_step_s = lambda norms, max_norm: Plan.expected_step_s(plan, norms, max_norm)  # type: ignore[arg-type]
    times = [9.0, 3.1, 3.0, 2.9]
    firing = PlanCheck.of(plan, times, gpu_peak_bytes=22 * GiB, grad_norms=[12.0] * 4, max_grad_norm=1.0)
    assert firing.planned_step_s == 3.0 and "step 3 s / 3 s (x1.00)" in firing.line()
    under = PlanCheck.of(plan, times, gpu_peak_bytes=22 * GiB, grad_norms=[0.5] * 4, max_grad_norm=1.0)
    assert under.planned_step_s == 2.0
    off = PlanCheck.of(plan, times, gpu_peak_bytes=22 * GiB, grad_norms=[12.0] * 4, max_grad_norm=0.0)
    assert off.planned_step_s == 2.0
