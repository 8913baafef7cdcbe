"""Optimizers that ship with slide-core, and how a run picks one by name.

Both are registered in the ``slide.optimizers`` entry-point group (``torch-adamw``: torch's kernels;
``fused-adamw``: one numba pass that reads bf16 gradients directly), so a third-party optimizer is chosen
the same way. ``auto`` is not a plugin: it is :func:`~slide_core.optim.fused_adamw.best_adamw`'s rule.
"""

from __future__ import annotations

import logging
from typing import Any

from slide_core import plugins
from slide_core.optim.adamw import TorchAdamW
from slide_core.optim.adamw_config import AdamWConfig
from slide_core.optimizer import Optimizer

__all__ = ["AUTO", "GROUP", "AdamWConfig", "TorchAdamW", "auto_optimizer_name", "build_optimizer"]

log = logging.getLogger(__name__)

GROUP = "slide.optimizers"
AUTO = "auto"
"""The fused one-pass AdamW when numba imports and compiles here, else ``TorchAdamW``."""


def auto_optimizer_name() -> str:
    """The plugin ``auto`` stands for here, without compiling anything (``slide plan`` reports it): what
    ``best_adamw`` picks unless the compile then fails."""
    from slide_core.optim.fused_adamw import FusedAdamW

    return "fused-adamw" if FusedAdamW.available() else "torch-adamw"


def build_optimizer(name: str, config: object | None = None, *, warmup: bool = True) -> Optimizer:
    """The optimizer called ``name`` (``auto`` or a ``slide.optimizers`` plugin), built with ``config``.

    A plugin is a :class:`~slide_core.optimizer.Optimizer` subclass constructed as ``cls(config)`` with a
    config of its own ``config_type`` (None: ``config_type()``, its defaults; ``auto`` is AdamW and takes
    an :class:`AdamWConfig`). When it has a ``warmup()`` (compiling its kernels), that runs here, before
    training, so an optimizer that cannot run on this machine fails now, in one line, instead of in the
    first step. Raises :class:`~slide_core.plugins.PluginError`.

    A compact optimizer state (an AdamW ``config.state_format`` bf16 or int8) is stored by ``CompactAdamW``,
    with the numba kernels (``auto`` with numba, ``fused-adamw``) or torch's ops (``torch-adamw``, ``auto``
    without numba); both round with the same hash, so either gives the same moments.

    ``warmup=False`` builds the same optimizer without compiling anything: for pricing its scratch (`slide
    plan`), never for stepping.
    """
    if isinstance(config, AdamWConfig) and config.state_format != "fp32":
        return _compact_optimizer(name, config, warmup=warmup)
    if name == AUTO:
        from slide_core.optim.fused_adamw import best_adamw  # numpy; numba only if it is installed

        return best_adamw(_config_of(name, AdamWConfig, config), warmup=warmup)
    optimizer_class = plugins.load(GROUP, name, expected=Optimizer)
    optimizer: Optimizer = optimizer_class(_config_of(name, optimizer_class.config_type, config))
    compile_kernels = getattr(optimizer, "warmup", None)
    if warmup and callable(compile_kernels):
        try:
            compile_kernels()
        except Exception as error:  # a missing compiler (numba), or a compile that fails on this machine
            raise plugins.PluginError(f"optimizer {name!r} cannot run here: {error}") from error
    return optimizer


def _config_of(name: str, config_type: type[Any], config: object | None) -> Any:
    """``config``, checked against the plugin's ``config_type`` (None: that type's defaults)."""
    if config is None:
        return config_type()
    if not isinstance(config, config_type):
        raise plugins.PluginError(f"optimizer {name!r} takes a {config_type.__name__}, got a {type(config).__name__}")
    return config


def _compact_optimizer(name: str, config: AdamWConfig, *, warmup: bool = True) -> Optimizer:
    """``CompactAdamW`` in the flavour ``name`` stands for; another plugin is refused in one line."""
    from slide_core.optim.compact_adamw import CompactAdamW

    if name not in (AUTO, "fused-adamw", "torch-adamw"):
        raise plugins.PluginError(
            f"optimizer {name!r} keeps fp32 state; optimizer state {config.state_format} needs auto, fused-adamw "
            "or torch-adamw"
        )
    fused = {AUTO: None, "fused-adamw": True, "torch-adamw": False}[name]
    try:
        optimizer = CompactAdamW(config, fused=fused)
        if warmup:
            optimizer.warmup()
    except Exception as error:  # no numba for fused-adamw, or a compile that fails on this machine
        if name != AUTO:
            raise plugins.PluginError(f"optimizer {name!r} cannot run here: {error}") from error
        log.warning("host optimizer: compact AdamW kernels failed to compile, using torch ops", exc_info=True)
        optimizer = CompactAdamW(config, fused=False)
    return optimizer
