"""This machine's measured rates: measuring (on tiny arrays), the per-machine cache, and what planning reads."""

from __future__ import annotations

import json
import logging

import pytest

from slide_hf.machine_rates import (
    TRAINING_MATMUL_SHARE,
    HostIdentity,
    MachineRates,
    MeasureSizes,
    cache_path,
    load_cached,
    measure_rates,
    planning_bandwidths,
    refresh_cached,
)
from slide_hf.planner import Bandwidths

TINY = MeasureSizes(
    host_numel=1 << 14, adam_numel=1 << 12, reps=1, optimizer="torch-adamw", state_formats=("fp32", "bf16")
)
HERE = HostIdentity("box", "Some CPU", "none")


@pytest.fixture
def environ(tmp_path):
    return {"XDG_CACHE_HOME": str(tmp_path / "cache")}


def _rates(**changes) -> MachineRates:
    values = {
        "identity": HERE,
        "measured_at": "2026-01-01T00:00:00+00:00",
        "host_copy_gbps": 20.0,
        "host_triad_gbps": 30.0,
        "cpu_adam_gparams": {"fp32": 2.0, "bf16": 2.5},
        **changes,
    }
    return MachineRates(**values)


def test_measuring_gives_positive_rates_for_every_state_format_asked():
    rates = measure_rates(TINY, HERE)
    assert rates.identity == HERE
    assert rates.host_copy_gbps > 0 and rates.host_triad_gbps > 0
    assert set(rates.cpu_adam_gparams) == {"fp32", "bf16"} and min(rates.cpu_adam_gparams.values()) > 0
    assert rates.cpu_adam_gbps("fp32") == pytest.approx(26 * rates.cpu_adam_gparams["fp32"])
    assert rates.cpu_adam_gbps("bf16") == pytest.approx(18 * rates.cpu_adam_gparams["bf16"])


def test_the_cache_is_written_read_and_refreshed(environ, monkeypatch):
    assert load_cached(HERE, environ) is None
    first, path = refresh_cached(TINY, HERE, environ)
    assert path == cache_path(HERE, environ) and path.parent.name == "slide"
    assert path.parent.parent.name == "cache"  # under XDG_CACHE_HOME
    assert load_cached(HERE, environ) == first
    later = _rates(measured_at="2026-02-02T00:00:00+00:00")
    monkeypatch.setattr("slide_hf.machine_rates.measure_rates", lambda sizes, identity: later)
    assert refresh_cached(TINY, HERE, environ)[0] == later
    assert load_cached(HERE, environ) == later
    assert list(path.parent.iterdir()) == [path]  # no temporary file left


def test_the_cache_defaults_to_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_path(HERE, {}).parent == tmp_path / ".cache" / "slide"


def test_each_machine_has_its_own_cache(environ):
    other = HostIdentity("box", "Some CPU", "NVIDIA H200")
    assert cache_path(other, environ) != cache_path(HERE, environ)
    path = cache_path(other, environ)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_rates().to_json()))  # HERE's rates under the other's name
    assert load_cached(other, environ) is None


@pytest.mark.parametrize(
    "text",
    ["{not json", json.dumps({"version": 99}), json.dumps({**_rates().to_json(), "host_triad_gbps": -1.0}), "[]"],
)
def test_a_broken_cache_is_one_line_and_measured_again(environ, caplog, text):
    path = cache_path(HERE, environ)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="slide.machine_rates"):
        assert load_cached(HERE, environ) is None
    [record] = caplog.records
    assert "\n" not in record.getMessage() and "`slide doctor` measures again" in record.getMessage()
    rates, _ = refresh_cached(TINY, HERE, environ)
    assert load_cached(HERE, environ) == rates


def test_planning_reads_the_cache_or_says_it_uses_the_defaults(environ):
    bandwidths, source = planning_bandwidths(identity=HERE, environ=environ)
    assert bandwidths == Bandwidths() and source.startswith("documented defaults")
    rates = _rates(h2d_gbps=40.0, d2h_gbps=30.0, gpu_mem_gbps=3000.0, gpu_tflops=500.0)
    path = cache_path(HERE, environ)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(rates.to_json()))
    bandwidths, source = planning_bandwidths(identity=HERE, environ=environ)
    assert source.startswith("measured here 2026-01-01")
    assert (bandwidths.h2d_gbps, bandwidths.d2h_gbps, bandwidths.host_mem_gbps) == (40.0, 30.0, 30.0)
    assert bandwidths.gpu_mem_gbps == 3000.0
    assert bandwidths.gpu_tflops == pytest.approx(500.0 * TRAINING_MATMUL_SHARE)  # achieved, not the peak
    assert bandwidths.cpu_adam_rate("bf16") == 2.5 and bandwidths.cpu_adam_rate("fp32") == 2.0
    assert bandwidths.cpu_adam_rate("int8") == pytest.approx(2.0 * 0.73)  # not measured: relative to fp32
    assert bandwidths.disk_gbps == Bandwidths().disk_gbps  # never measured


def test_rates_without_a_gpu_keep_the_defaults_gpu_rates():
    bandwidths = _rates().bandwidths()
    assert bandwidths.h2d_gbps == Bandwidths().h2d_gbps and bandwidths.gpu_tflops == Bandwidths().gpu_tflops


def test_a_split_master_is_measured_for_every_state_format_the_optimizer_takes_it():
    rates = measure_rates(TINY, HERE)
    assert set(rates.cpu_adam_split_gparams) == {"fp32", "bf16"} and min(rates.cpu_adam_split_gparams.values()) > 0
    bandwidths = rates.bandwidths()
    assert bandwidths.cpu_adam_rate("bf16", "split") == rates.cpu_adam_split_gparams["bf16"]
    assert rates.pcie_duplex_gbps is None  # no CUDA GPU here


def test_planning_reads_the_split_master_and_duplex_rates_or_their_defaults():
    from slide_hf.planner.inputs import DUPLEX_SPEED, SPLIT_MASTER_SPEED

    measured = _rates(h2d_gbps=40.0, d2h_gbps=30.0, cpu_adam_split_gparams={"bf16": 1.5}, pcie_duplex_gbps=50.0)
    bandwidths = MachineRates.from_json(json.loads(json.dumps(measured.to_json()))).bandwidths()
    assert bandwidths.cpu_adam_rate("bf16", "split") == 1.5 and bandwidths.duplex_gbps == 50.0
    assert bandwidths.cpu_adam_rate("fp32", "split") == pytest.approx(2.0 * SPLIT_MASTER_SPEED)
    unmeasured = _rates(h2d_gbps=40.0, d2h_gbps=30.0).bandwidths()
    assert unmeasured.duplex_gbps == pytest.approx(DUPLEX_SPEED * 30.0)
    assert unmeasured.cpu_adam_rate("bf16", "split") == pytest.approx(2.5 * SPLIT_MASTER_SPEED)


def test_a_version_1_cache_still_loads_without_the_rates_it_lacks(environ):
    old = _rates(h2d_gbps=40.0).to_json()
    old = {key: value for key, value in old.items() if key not in ("cpu_adam_split_gparams", "pcie_duplex_gbps")}
    path = cache_path(HERE, environ)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**old, "version": 1}))
    rates = load_cached(HERE, environ)
    assert rates is not None and rates.h2d_gbps == 40.0
    assert rates.cpu_adam_split_gparams == {} and rates.pcie_duplex_gbps is None


def test_a_training_run_measures_a_machine_nothing_cached_once(environ, caplog):
    """`slide train` and `slide bench` on a GPU pass ``measure_if_absent``: the documented defaults are a slow
    machine's (an 8B step planned at 5x its time on an H100 host), so an unmeasured machine is measured once
    and cached; the next run reads the cache; `slide plan` (without it) never measures."""
    assert planning_bandwidths(identity=HERE, environ=environ)[1].startswith("documented defaults")
    assert not cache_path(HERE, environ).exists()  # planning alone wrote nothing
    with caplog.at_level(logging.INFO, logger="slide.machine_rates"):
        bandwidths, source = planning_bandwidths(identity=HERE, environ=environ, measure_if_absent=True, sizes=TINY)
    assert "measuring them once" in caplog.text and "before this run" in source
    cached = load_cached(HERE, environ)
    assert cached is not None and bandwidths == cached.bandwidths(Bandwidths())
    assert bandwidths.host_mem_gbps == cached.host_triad_gbps and bandwidths != Bandwidths()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="slide.machine_rates"):
        again, source = planning_bandwidths(identity=HERE, environ=environ, measure_if_absent=True, sizes=TINY)
    assert again == bandwidths and "measuring" not in caplog.text and source.startswith("measured here")


def test_a_measurement_that_fails_plans_from_the_defaults(environ, caplog, monkeypatch):
    import slide_hf.machine_rates as machine_rates

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(machine_rates, "refresh_cached", full_disk)
    with caplog.at_level(logging.INFO, logger="slide.machine_rates"):
        bandwidths, source = planning_bandwidths(identity=HERE, environ=environ, measure_if_absent=True, sizes=TINY)
    assert bandwidths == Bandwidths() and source.startswith("documented defaults")
    assert "No space left on device" in caplog.text and "documented defaults" in caplog.text
