"""`slide doctor`, run in-process through `slide_hf.cli.main.main`."""

from __future__ import annotations

import json
import sys

import pytest

from slide_core import plugins
from slide_hf.cli import doctor
from slide_hf.machine_rates import MeasureSizes, load_cached

SECTIONS = ("versions", "device", "host", "kernels", "storage", "plugins", "machine_rates")

TINY = MeasureSizes(host_numel=1 << 14, adam_numel=1 << 12, reps=1, optimizer="torch-adamw", state_formats=("fp32",))


@pytest.fixture(autouse=True)
def _tiny_measurements_in_a_private_cache(monkeypatch, tmp_path):
    """`slide doctor` measures this machine's rates and caches them: on tiny arrays, in this test's directory."""
    monkeypatch.setattr(doctor, "MEASURE_SIZES", TINY)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_doctor_text(slide):
    status, out, err = slide("doctor")
    assert status == 0, err
    for section in SECTIONS:
        assert f"{section}:" in out
    for line in ("python:", "torch:", "transformers:", "slide-core:", "ram_total_bytes:", "backend:"):
        assert line in out
    assert "slide.adapters: " in out and "llama" in out
    assert "GiB" in out


def test_doctor_json(slide):
    status, out, _ = slide("doctor", "--json")
    assert status == 0
    report = json.loads(out)
    assert tuple(report) == SECTIONS
    versions = report["versions"]
    assert versions["python"].startswith(".".join(map(str, sys.version_info[:2])))
    assert versions["torch"] != "not installed"
    assert report["host"]["ram_total_bytes"] >= report["host"]["ram_available_bytes"] > 0
    assert report["host"]["cpu_cores_logical"] >= 1
    assert report["device"]["backend"] in ("cpu", "cuda", "rocm")
    assert set(report["plugins"]) == set(plugins.GROUPS)
    assert "llama" in report["plugins"]["slide.adapters"]
    assert report["storage"]["gds"] and not report["storage"]["gds"].startswith("gds:")
    assert report["kernels"]["flash_attn"].startswith(("yes", "no"))


def test_missing_distribution_reads_not_installed(monkeypatch):
    monkeypatch.setattr(doctor, "DISTRIBUTIONS", ("surely-not-a-real-distribution",))
    assert doctor.collect()["versions"]["surely-not-a-real-distribution"] == "not installed"


def test_missing_or_broken_optional_packages_never_crash(slide, monkeypatch):
    # None in sys.modules makes `import` raise ImportError, as for a package that is absent.
    for module in ("flash_attn", "kvikio", "slide_io", "slide_kernels", "slide_rocm", "slide_rocm.policy"):
        monkeypatch.setitem(sys.modules, module, None)

    def broken(group: str) -> list[str]:
        raise OSError(f"metadata of {group} is unreadable\nsecond line")

    monkeypatch.setattr(plugins, "available", broken)
    status, out, err = slide("doctor", "--json")
    assert status == 0, err
    report = json.loads(out)
    assert report["kernels"]["flash_attn"].startswith("no (")
    assert report["storage"]["kvikio"].startswith("no (")
    assert report["storage"]["tiers"] == "error: OSError: metadata of slide.tiers is unreadable"
    assert report["storage"]["gds"]  # a line saying why there is no answer, never a crash
    assert "slide-kernels unusable" in report["kernels"]["triton"]
    assert report["plugins"]["slide.devices"] == "error: OSError: metadata of slide.devices is unreadable"


def test_a_failing_probe_becomes_an_error_entry(slide, monkeypatch):
    def explode() -> dict:
        raise RuntimeError("driver went away")

    monkeypatch.setattr(doctor, "_device", explode)
    status, out, _ = slide("doctor")
    assert status == 0
    assert "error: RuntimeError: driver went away" in out


def test_doctor_says_which_path_linear_attention_runs(slide, monkeypatch):
    """Per device type, flash-linear-attention or transformers' torch path, and why: for any model with
    delta-net layers, and with --model for that model's own choice."""
    import torch

    from slide_hf.adapters import linear_attention

    def absent():
        raise ModuleNotFoundError("No module named 'fla'", name="fla")

    monkeypatch.setattr(linear_attention, "_import_fla", absent)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine without fla
    cpu = "torch path (flash-linear-attention's kernels run on CUDA only, not on the cpu device)"
    for argv in (("doctor", "--json"), ("doctor", "--model", "test-qwen3.5", "--json")):
        status, out, err = slide(*argv)
        assert status == 0, err
        paths = json.loads(out)["kernels"]["linear_attention"]
        assert paths == {"cuda": "torch path (flash-linear-attention is not installed)", "cpu": cpu}, argv
    monkeypatch.setenv(linear_attention.ENV_VAR, "torch")
    status, out, _ = slide("doctor")
    assert status == 0
    assert "    cuda: torch path (SLIDE_LINEAR_ATTENTION=torch)" in out.splitlines()


# -- plugins speak for themselves ------------------------------------------------------------------------
def test_doctor_imports_no_plugin_distribution():
    """slide-io and slide-rocm are reached through the plugin registry only (their doctor_facts)."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(doctor.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.split(".")[0] in ("slide_io", "slide_rocm")}


def test_storage_asks_every_tier_plugin(monkeypatch):
    from slide_core.tier import Tier

    class Speaks(Tier):
        name = "speaks"

        @classmethod
        def doctor_facts(cls) -> dict[str, str]:
            return {"gds": "real, through a third-party tier", "speaks": "fine"}

    def load(group, name, expected=None):
        if name == "broken":
            raise plugins.PluginError("slide.tiers plugin 'broken' (x:Y, from x) does not import (boom)")
        return Speaks

    monkeypatch.setattr(plugins, "available", lambda group: ["broken", "speaks"])
    monkeypatch.setattr(plugins, "load", load)
    storage = doctor.collect()["storage"]
    assert storage["gds"] == "real, through a third-party tier" and storage["speaks"] == "fine"
    assert storage["broken"].startswith("PluginError: slide.tiers plugin 'broken'")


def test_storage_names_the_distribution_a_missing_gds_tier_needs(monkeypatch):
    monkeypatch.setattr(plugins, "available", lambda group: [])
    monkeypatch.setattr(plugins, "install_hint", lambda group, name: f"`{name}` needs slide-io: pip install slide-io")
    assert doctor.collect()["storage"]["gds"] == "`gds` needs slide-io: pip install slide-io"


def test_device_section_carries_the_device_plugins_facts(monkeypatch):
    from slide_core.devices.cpu import CPUDevice

    class Policied(CPUDevice):
        @classmethod
        def doctor_facts(cls) -> dict[str, str]:
            return {"attention": "sdpa (AOTriton)"}

    seen = []

    def load(group, name, expected=None):
        seen.append((group, name))
        return Policied

    monkeypatch.setattr(plugins, "load", load)
    assert doctor._plugin_facts("slide.devices", "rocm") == {"attention": "sdpa (AOTriton)"}
    assert seen == [("slide.devices", "rocm")]


def test_doctor_measures_the_machine_rates_and_caches_them(slide, tmp_path):
    status, out, err = slide("doctor", "--json")
    assert status == 0, err
    rates = json.loads(out)["machine_rates"]
    assert "error" not in rates, rates
    assert rates["host_triad_gbps"] > 0 and rates["cache"].startswith(str(tmp_path / "cache" / "slide"))
    assert rates["cpu_adam"]["fp32"].endswith("GB/s)")
    cached = load_cached()
    assert cached is not None and cached.measured_at == rates["measured_at"]
    status, out, _ = slide("doctor")
    assert status == 0 and "machine_rates:" in out and "host_triad_gbps:" in out
    assert load_cached().measured_at >= cached.measured_at  # measured again


def test_doctor_measures_again_over_a_broken_cache(slide, tmp_path):
    from slide_hf.machine_rates import HostIdentity, cache_path

    path = cache_path(HostIdentity.here())
    path.parent.mkdir(parents=True)
    path.write_text("{broken")
    assert load_cached() is None
    status, _, err = slide("doctor", "--json")
    assert status == 0, err
    assert load_cached() is not None


def test_doctor_says_which_host_adamw_runs_and_the_package_that_needs_numba_requires_it(slide):
    """The fused host AdamW is the fast path on the resource that usually binds; a user who installs the
    packages gets numba with slide-core, and `slide doctor` says which kernel runs."""
    import tomllib
    from pathlib import Path

    status, out, err = slide("doctor", "--json")
    assert status == 0, err
    assert json.loads(out)["kernels"]["host_adamw"].startswith("FusedAdamW (numba ")
    pyproject = Path(__file__).parents[2] / "packages" / "slide-core" / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("numba") for d in dependencies)
