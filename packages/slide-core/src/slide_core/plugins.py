"""Entry-point plugins: devices, tiers, optimizers and adapters, discovered lazily.

Listing plugins reads package metadata only; a plugin's module is imported when it is loaded, so heavy
imports (kvikio, HIP specifics, triton, numba) happen only for what is used.

Every name a user can pick (``--device``, ``--offload-optimizer``, ``--optimizer``, a model's
``model_type``) is looked up here, so a third-party distribution that declares an entry point in one of
:data:`GROUPS` is selectable exactly like the built-in ones. Failures are one line: an unknown name lists
what is installed (and, for a well-known name, which distribution provides it), a plugin whose module does
not import names the distribution that registered it, and a plugin of the wrong kind names both kinds.
"""

from __future__ import annotations

import functools
from importlib.metadata import EntryPoint, entry_points
from typing import Any, TypeVar

__all__ = ["GROUPS", "PluginError", "available", "clear_cache", "install_hint", "load"]

T = TypeVar("T")

GROUPS = ("slide.devices", "slide.tiers", "slide.optimizers", "slide.adapters")

_PROVIDERS: dict[tuple[str, str], str] = {
    ("slide.tiers", "pinned"): "slide-io",
    ("slide.tiers", "nvme"): "slide-io",
    ("slide.tiers", "gds"): "slide-io",
    ("slide.tiers", "hipfile"): "slide-rocm",
    ("slide.devices", "rocm"): "slide-rocm",
}
"""Which distribution provides the well-known plugins, for the 'pip install ...' hint."""


class PluginError(LookupError):
    """No plugin of that name, it does not import, or it is not what the caller expected."""


@functools.cache
def _entry_points(group: str) -> dict[str, EntryPoint]:
    # Cached per process: package metadata does not change while a run goes on. A test that installs a
    # distribution on sys.path calls clear_cache() to see it.
    return {ep.name: ep for ep in entry_points(group=group)}


def clear_cache() -> None:
    """Forget the cached listings, so distributions added to ``sys.path`` since are found."""
    _entry_points.cache_clear()


def available(group: str) -> list[str]:
    """Names registered in ``group``, sorted."""
    if group not in GROUPS:
        raise PluginError(f"unknown plugin group {group!r}; expected one of {', '.join(GROUPS)}")
    return sorted(_entry_points(group))


def install_hint(group: str, name: str) -> str:
    """``"`nvme` needs slide-io: pip install slide-io"`` for a well-known plugin that is not installed,
    else ``""``."""
    provider = _PROVIDERS.get((group, name))
    if provider is None or name in (_entry_points(group) if group in GROUPS else {}):
        return ""
    return f"`{name}` needs {provider}: pip install {provider}"


def load(group: str, name: str, expected: type[T] | None = None) -> Any:
    """Load the object registered as ``name`` in ``group`` and check it subclasses ``expected``."""
    found = _entry_points(group) if group in GROUPS else {}
    if name not in found:
        known = ", ".join(available(group)) or "none"
        hint = install_hint(group, name)
        raise PluginError(f"no {group} plugin named {name!r} (installed: {known})" + (f"; {hint}" if hint else ""))
    entry = found[name]
    try:
        obj = entry.load()
    except ImportError as error:  # the plugin's module, or something it imports, is missing or broken
        dist = entry.dist.name if entry.dist is not None else "its distribution"
        raise PluginError(
            f"{group} plugin {name!r} ({entry.value}, from {dist}) does not import ({error}); "
            f"check that {dist} and what it needs are installed: pip install {dist}"
        ) from error
    if expected is not None and not (isinstance(obj, type) and issubclass(obj, expected)):
        raise PluginError(f"{group} plugin {name!r} is {obj!r}, not a subclass of {expected.__name__}")
    return obj
