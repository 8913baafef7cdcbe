"""Lazy access to kvikio (the Python face of NVIDIA cuFile / GPUDirect Storage).

kvikio is an optional, CUDA-specific dependency (``pip install 'slide-io[gds]'``). It is imported only when
a GDS tier is built or ``gds_status()`` is asked, never by ``import slide_io``, so CPU and ROCm installs
never touch it. Its API for reading the compatibility mode changed across releases; ``kvikio_mode``
handles each form.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["gds_status", "kvikio_mode", "load_kvikio"]


def load_kvikio() -> tuple[ModuleType | None, str]:
    """``(kvikio, version)`` or ``(None, why it could not be imported)``.

    Any exception counts as unavailable: a wheel for another CUDA major fails with OSError, not
    ImportError.
    """
    try:
        kvikio = importlib.import_module("kvikio")
    except Exception as error:
        return None, f"{type(error).__name__}: {error}"
    return kvikio, str(getattr(kvikio, "__version__", "unknown version"))


def _is_compat(value: Any) -> bool:
    """Decode a compat-mode value: a bool (kvikio < 24.12) or a ``CompatMode`` enum (ON/OFF/AUTO)."""
    if isinstance(value, bool):
        return value
    name = str(getattr(value, "name", value)).upper()
    # AUTO without ``is_compat_mode_preferred`` to resolve it: cuFile may or may not load, assume not.
    return name != "OFF"


def kvikio_mode(kvikio: ModuleType) -> str:
    """``"gds"`` when kvikio drives cuFile, ``"compat"`` when it falls back to POSIX I/O itself.

    Tried in order: ``defaults.is_compat_mode_preferred()`` (24.12+, resolves AUTO),
    ``defaults.get("compat_mode")`` (25.04+), ``defaults.compat_mode()`` (older, deprecated in 25.04).
    """
    defaults = getattr(kvikio, "defaults", None)
    if defaults is None:
        return "compat"
    if callable(getattr(defaults, "is_compat_mode_preferred", None)):
        return "compat" if defaults.is_compat_mode_preferred() else "gds"
    if callable(getattr(defaults, "get", None)):
        try:
            return "compat" if _is_compat(defaults.get("compat_mode")) else "gds"
        except (KeyError, ValueError, TypeError):
            pass
    if callable(getattr(defaults, "compat_mode", None)):
        return "compat" if _is_compat(defaults.compat_mode()) else "gds"
    return "compat"


def gds_status() -> str:
    """One line for ``slide doctor``: is kvikio there, and does it use GPUDirect Storage or POSIX I/O."""
    kvikio, detail = load_kvikio()
    if kvikio is None:
        return (
            f"gds: kvikio not importable ({detail}); the gds tier falls back to POSIX I/O "
            "(install with: pip install 'slide-io[gds]')"
        )
    try:
        mode = kvikio_mode(kvikio)
    except Exception as error:
        return f"gds: kvikio {detail} imported but its compat mode could not be read ({error})"
    if mode == "gds":
        line = f"gds: kvikio {detail}, GPUDirect Storage (cuFile) enabled"
    else:
        line = (
            f"gds: kvikio {detail} in compatibility mode: POSIX I/O through host bounce buffers "
            "(libcufile missing, /run/udev not mounted, or KVIKIO_COMPAT_MODE=ON)"
        )
    import torch  # already imported by any user of slide_io; kept local to keep this module light

    if not torch.cuda.is_available():
        line += "; no CUDA device visible to torch"
    return line
