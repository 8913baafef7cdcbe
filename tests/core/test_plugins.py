"""slide_core.plugins: what is installed, loading by name, and the one-line failures (unknown name, a
plugin package that is missing, a plugin that does not import, a plugin of the wrong kind).

Third-party plugins are real distributions: a ``*.dist-info`` with ``entry_points.txt`` on ``sys.path``
(tests/conftest.py's ``install_distribution``), found through importlib.metadata like any pip install.
"""

from __future__ import annotations

import sys

import pytest

from slide_core import Device, Optimizer, Tier, plugins
from slide_core.devices.cpu import CPUDevice
from slide_core.optim import TorchAdamW, auto_optimizer_name, build_optimizer
from slide_core.optim.adamw_config import AdamWConfig
from slide_core.optim.fused_adamw import FusedAdamW
from slide_core.tiers.host_ram import HostRamTier

TIER_SOURCE = """
from slide_core.tiers.host_ram import HostRamTier


class ScratchTier(HostRamTier):
    name = "scratch"


class NotATier:
    pass
"""


def test_built_in_plugins_are_listed_and_loaded() -> None:
    assert {"cpu", "cuda"} <= set(plugins.available("slide.devices"))
    assert {"torch-adamw", "fused-adamw"} <= set(plugins.available("slide.optimizers"))
    assert "ram" in plugins.available("slide.tiers")
    assert plugins.load("slide.devices", "cpu", expected=Device) is CPUDevice
    assert plugins.load("slide.tiers", "ram", expected=Tier) is HostRamTier
    assert plugins.load("slide.optimizers", "torch-adamw", expected=Optimizer) is TorchAdamW
    assert plugins.load("slide.optimizers", "fused-adamw", expected=Optimizer) is FusedAdamW


def test_available_is_sorted_and_refuses_an_unknown_group() -> None:
    names = plugins.available("slide.tiers")
    assert names == sorted(names)
    with pytest.raises(plugins.PluginError, match=r"unknown plugin group 'slide.engines'; expected one of"):
        plugins.available("slide.engines")


def test_an_unknown_name_lists_what_is_installed() -> None:
    with pytest.raises(plugins.PluginError) as raised:
        plugins.load("slide.devices", "tpu")
    message = str(raised.value)
    assert "no slide.devices plugin named 'tpu'" in message and "cpu" in message and "cuda" in message
    assert "\n" not in message


def test_a_missing_plugin_package_says_what_to_pip_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """slide-io uninstalled, as far as entry points can tell: its tiers are gone from the listing."""
    listing = plugins._entry_points

    def without_slide_io(group: str) -> dict:
        return {name: ep for name, ep in listing(group).items() if ep.dist is None or ep.dist.name != "slide-io"}

    monkeypatch.setattr(plugins, "_entry_points", without_slide_io)
    assert "nvme" not in plugins.available("slide.tiers")
    assert plugins.install_hint("slide.tiers", "nvme") == "`nvme` needs slide-io: pip install slide-io"
    with pytest.raises(plugins.PluginError, match=r"`nvme` needs slide-io: pip install slide-io$"):
        plugins.load("slide.tiers", "nvme", expected=Tier)
    assert plugins.install_hint("slide.tiers", "ram") == ""  # installed: nothing to install
    assert plugins.install_hint("slide.tiers", "tape") == ""  # not a name slide knows a provider for


def test_a_new_distribution_is_seen_after_clear_cache(install_distribution) -> None:
    assert "scratch" not in plugins.available("slide.tiers")
    install_distribution(
        "slide-scratch",
        {"slide_scratch_tier": TIER_SOURCE},
        {"slide.tiers": {"scratch": "slide_scratch_tier:ScratchTier"}},
    )
    assert "scratch" in plugins.available("slide.tiers")
    tier_class = plugins.load("slide.tiers", "scratch", expected=Tier)
    assert issubclass(tier_class, HostRamTier) and tier_class.name == "scratch"


def test_a_plugin_of_the_wrong_kind_names_both(install_distribution) -> None:
    install_distribution(
        "slide-wrong", {"slide_wrong_tier": TIER_SOURCE}, {"slide.tiers": {"wrong": "slide_wrong_tier:NotATier"}}
    )
    with pytest.raises(plugins.PluginError, match=r"slide.tiers plugin 'wrong' is .*NotATier.*not a subclass of Tier"):
        plugins.load("slide.tiers", "wrong", expected=Tier)
    # A plugin registered in one group is not accepted as another kind.
    with pytest.raises(plugins.PluginError, match="not a subclass of Device"):
        plugins.load("slide.tiers", "ram", expected=Device)


def test_a_plugin_that_does_not_import_names_its_distribution(install_distribution) -> None:
    install_distribution("slide-broken", {}, {"slide.devices": {"broken": "slide_module_that_is_absent:Device"}})
    with pytest.raises(plugins.PluginError) as raised:
        plugins.load("slide.devices", "broken", expected=Device)
    message = str(raised.value)
    assert "slide.devices plugin 'broken'" in message and "from slide-broken" in message
    assert "does not import" in message and "slide_module_that_is_absent" in message
    assert "pip install slide-broken" in message


def test_build_optimizer_by_name() -> None:
    config = AdamWConfig(weight_decay=0.1)
    torch_adamw = build_optimizer("torch-adamw", config)
    assert type(torch_adamw) is TorchAdamW and torch_adamw.config is config
    auto = build_optimizer("auto", config)
    assert type(auto) is (FusedAdamW if FusedAdamW.available() else TorchAdamW)
    assert plugins.load("slide.optimizers", auto_optimizer_name()) is type(auto)
    with pytest.raises(plugins.PluginError, match=r"no slide\.optimizers plugin named 'sgd'"):
        build_optimizer("sgd", config)


def test_an_optimizer_that_cannot_run_here_fails_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fused-adamw`` without numba: one line at setup, not an exception in the first step."""
    import slide_core.optim.fused_adamw as fused

    fused._numba_available.cache_clear()
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` now raises ImportError
    try:
        with pytest.raises(plugins.PluginError, match=r"optimizer 'fused-adamw' cannot run here: .*numba"):
            build_optimizer("fused-adamw", AdamWConfig())
        assert type(build_optimizer("auto", AdamWConfig())) is TorchAdamW  # auto falls back instead
    finally:
        fused._numba_available.cache_clear()
