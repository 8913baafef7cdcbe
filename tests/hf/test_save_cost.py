"""What a checkpoint save costs (slide_hf/planner/save_cost.py): the pause and, with --save-async, the host
memory of the copy; priced alike by `slide plan` and `slide train`, and the run's log measures it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from slide_hf import recipe, setup
from slide_hf.planner import Bandwidths
from slide_hf.planner.output_disk import OutputDisk
from slide_hf.planner.save_cost import save_cost
from slide_hf.recipe import TrainConfig, train

GiB = 2**30
RATES = Bandwidths(disk_gbps=2.0, host_mem_gbps=100.0)


def _outputs(checkpoint: int = 90 * GiB) -> OutputDisk:
    return OutputDisk(checkpoint_bytes=checkpoint, checkpoints_at_once=2, export_bytes=15 * GiB, checkpoints_kept=1)


def test_a_foreground_save_pauses_for_the_write() -> None:
    cost = save_cost(
        _outputs(), background=False, host_peak_bytes=100 * GiB, host_available=120 * GiB, bandwidths=RATES
    )
    assert cost.pause_s == pytest.approx(90 * GiB / 2e9) and cost.copy_bytes == 0
    assert cost.host_peak_bytes == 100 * GiB
    assert "writing 90.0 GiB at 2 GB/s, assumed until a save on this disk is measured" in cost.why()
    assert "--save-async would pause for a copy instead" in cost.why()
    measured = save_cost(
        _outputs(), background=False, host_peak_bytes=0, host_available=None, bandwidths=RATES, write_gbps=0.5
    )
    assert measured.pause_s == pytest.approx(90 * GiB / 0.5e9) and "at 0.5 GB/s, measured by a save" in measured.why()


def test_a_background_save_pauses_for_a_copy_and_holds_it() -> None:
    cost = save_cost(_outputs(), background=True, host_peak_bytes=100 * GiB, host_available=200 * GiB, bandwidths=RATES)
    assert cost.in_background and cost.copy_bytes == 90 * GiB
    assert cost.pause_s == pytest.approx(2 * 90 * GiB / 100e9)  # read once, written once
    assert cost.host_peak_bytes == 190 * GiB
    assert cost.describe().startswith("each checkpoint save pauses training 1.93 s: a copy of 90.0 GiB")


def test_a_copy_that_does_not_fit_is_priced_as_the_foreground_write() -> None:
    """The run writes such saves in the foreground (``_room_for_a_copy``), so that is what is priced."""
    cost = save_cost(_outputs(), background=True, host_peak_bytes=100 * GiB, host_available=180 * GiB, bandwidths=RATES)
    assert not cost.copy_fits and not cost.in_background
    assert cost.pause_s == cost.write_s and cost.host_peak_bytes == 100 * GiB and cost.copy_bytes == 0
    assert "does not fit beside the run's host peak" in cost.why()
    unknown = save_cost(_outputs(), background=True, host_peak_bytes=100 * GiB, host_available=None, bandwidths=RATES)
    assert unknown.in_background  # no host to check against: priced as asked


def test_slide_plan_prices_the_copy(slide, monkeypatch) -> None:
    monkeypatch.setattr(setup, "fused_loss_available", lambda: True)
    base = ("plan", "--model", "tiny-llama", "--device", "cpu", "--seq-len", "64", "--host-memory", "64GiB")
    status, out, err = slide(*base, "--json")
    assert status == 0, err
    plain = json.loads(out)
    status, out, err = slide(*base, "--save-async", "--json")
    assert status == 0, err
    background = json.loads(out)
    saving = background["checkpoint_save"]
    assert saving["in_background"] and saving["copy_bytes"] == background["output_disk"]["checkpoint_bytes"]
    assert saving["host_peak_bytes"] == background["host_peak_bytes"] + saving["copy_bytes"]
    assert not plain["checkpoint_save"]["background"] and plain["checkpoint_save"]["copy_bytes"] == 0
    status, out, err = slide(*base, "--save-async")
    assert status == 0, err
    assert "with --save-async" in out and "each save" in out and "at host memory speed" in out
    room = plain["host_peak_bytes"] + saving["copy_bytes"] // 2  # for the run, not for its copy beside it
    status, out, err = slide(*base, "--host-memory", f"{room / 2**20:.3f}MiB", "--save-async")
    assert status == 0, err
    assert "with --save-async" not in out and "does not fit beside the run's host peak" in out


def _config(output: Path, **overrides: object) -> TrainConfig:
    base: dict[str, object] = dict(
        output=output, device="cpu", dtype="float32", steps=4, seq_len=32, batch_size=2, save_every=2, seed=3
    )
    base.update(overrides)
    return TrainConfig(**base)  # type: ignore[arg-type]


@pytest.mark.usefixtures("torch_kernels")
def test_the_run_logs_the_priced_and_the_measured_pause(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="slide.train"):
        train(_config(tmp_path / "run", save_async=True))
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("each checkpoint save pauses training") and "copy of" in line for line in lines)
    paused = [line for line in lines if "training paused" in line]
    assert [line.split(" ")[3] for line in paused] == ["2", "4"]
    assert all("copied; written in the background" in line for line in paused)
    check = next(line for line in lines if line.startswith("measured against planned"))
    assert "host peak" in check


@pytest.mark.usefixtures("torch_kernels")
def test_the_run_warns_when_the_copy_cannot_fit(tmp_path: Path, caplog, monkeypatch) -> None:
    monkeypatch.setattr(recipe, "available_host_bytes", lambda: 1)
    with caplog.at_level(logging.INFO, logger="slide.train"):
        train(_config(tmp_path / "run", save_async=True, steps=2))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith("--save-async: each checkpoint save pauses training") for w in warnings)
    assert any("does not fit beside the run's host peak" in w for w in warnings)


@pytest.mark.usefixtures("torch_kernels")
def test_a_run_that_saves_only_at_its_end_prices_nothing(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="slide.train"):
        train(_config(tmp_path / "run", save_every=0, steps=2))
    lines = [r.getMessage() for r in caplog.records]
    assert not any(line.startswith("each checkpoint save pauses") for line in lines)
    assert any(line.startswith("checkpoint of step 2 written: training paused") for line in lines)


@pytest.mark.usefixtures("torch_kernels")
def test_a_foreground_save_measures_the_disk_for_the_next_plan(tmp_path: Path, monkeypatch, caplog) -> None:
    """The first run prices its saves at the assumed disk rate and keeps the rate its saves were written
    at for that file system; the next run, and `slide plan`, price with it (slide_hf/in_step_rates.py)."""
    from slide_hf import in_step_rates

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(in_step_rates, "_MIN_WRITE_BYTES", 1)  # tiny-llama's checkpoint is 34 MiB
    with caplog.at_level(logging.INFO, logger="slide.train"):
        train(_config(tmp_path / "first", steps=2))
    first = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("each checkpoint save"))
    assert "assumed until a save on this disk is measured" in first
    rate = in_step_rates.checkpoint_write_gbps(tmp_path / "elsewhere")  # the same file system
    assert rate is not None and rate > 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="slide.train"):
        train(_config(tmp_path / "second", steps=2))
    second = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("each checkpoint save"))
    assert "measured by a save on this disk" in second


def test_a_rates_file_without_write_rates_still_loads() -> None:
    """A cache written before checkpoint writes were measured reads back with none."""
    from slide_hf.in_step_rates import InStepRates

    old = {
        "version": 1,
        "identity": {"hostname": "h", "cpu_model": "c", "gpu_name": "g"},
        "measured_at": "2026-12-06T00:00:00+00:00",
        "cpu_adam_busy_gparams": {"fp32/fp32": 2.0},
        "gpu_tflops": {},
    }
    assert InStepRates.from_json(old).checkpoint_write_gbps == {}
