"""Byte sizes as people write them (``24GiB``, ``80GB``) and as the planner prints them (``30.1 GiB``).

Kept apart from the byte and time models so the CLI can read a ``--gpu-memory`` flag, and every report
can format a number, without knowing anything about models or engines.
"""

from __future__ import annotations

import re

from slide_hf.errors import UserError

__all__ = ["format_bytes", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, *, what: str = "size") -> int:
    """``"24GiB"`` -> 25769803776. Accepts B, KB/KiB, MB/MiB, GB/GiB, TB/TiB (any case; GB = 1e9,
    GiB = 2**30), decimals (``1.5GiB``) and plain byte counts. ``what`` names the option in the error."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise UserError(f"{what}: cannot read {text!r} as a size; use e.g. 24GiB, 80GB, 512MiB or a byte count")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(f"{what}: size must be positive, got {text!r}")
    return value


def format_bytes(n: int | float) -> str:
    """Binary units, one decimal: ``30.1 GiB``, ``512.0 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
