"""Entry-point plugins: devices, tiers, optimizers and adapters, discovered lazily.

Listing plugins reads package metadata only; a plugin's module is imported when it is loaded, so heavy
imports (kvikio, HIP specifics, triton) happen only for what is used.
"""

from __future__ import annotations

import functools
from importlib.metadata import EntryPoint, entry_points
from typing import Any, TypeVar

__all__ = ["GROUPS", "PluginError", "available", "load"]

T = TypeVar("T")

GROUPS = ("slide.devices", "slide.tiers", "slide.optimizers", "slide.adapters")

_PROVIDERS: dict[tuple[str, str], str] = {
    ("slide.tiers", "pinned"): "slide-io",
    ("slide.tiers", "nvme"): "slide-io",
    ("slide.tiers", "gds"): "slide-io",
    ("slide.devices", "rocm"): "slide-rocm",
}
"""Which distribution provides the well-known plugins, for the 'pip install ...' hint."""


class PluginError(LookupError):
    """No plugin of that name, or it is not what the caller expected."""


@functools.cache
def _entry_points(group: str) -> dict[str, EntryPoint]:
    # Cached per process: package metadata does not change while we run. Tests can clear it with
    # ``_entry_points.cache_clear()``.
    return {ep.name: ep for ep in entry_points(group=group)}


def available(group: str) -> list[str]:
    """Names registered in ``group``, sorted."""
    if group not in GROUPS:
        raise PluginError(f"unknown plugin group {group!r}; expected one of {', '.join(GROUPS)}")
    return sorted(_entry_points(group))


def load(group: str, name: str, expected: type[T] | None = None) -> Any:
    """Load the object registered as ``name`` in ``group`` and check it subclasses ``expected``."""
    found = _entry_points(group) if group in GROUPS else {}
    if name not in found:
        known = ", ".join(available(group)) or "none"
        provider = _PROVIDERS.get((group, name))
        hint = f"; `{name}` needs {provider}: pip install {provider}" if provider else ""
        raise PluginError(f"no {group} plugin named {name!r} (installed: {known}){hint}")
    obj = found[name].load()
    if expected is not None and not (isinstance(obj, type) and issubclass(obj, expected)):
        raise PluginError(f"{group} plugin {name!r} is {obj!r}, not a subclass of {expected.__name__}")
    return obj
