"""Byte sizes as people write them (``24GiB``, ``80GB``) and as the planner prints them (``30.1 GiB``).

Kept apart from the planner so the options layer and the CLI can read a ``--gpu-memory`` flag, and every report
can format a number, without knowing anything about models or engines.
"""

from __future__ import annotations

import re

from slide_hf.errors import UserError

__all__ = ["SIZE_RULE", "format_bytes", "parse_size"]

SIZE_RULE = (
    "sizes: a plain number is GiB (24 = 24 GiB); K, M, G, T and KiB, MiB, GiB, TiB are powers of 1024; "
    "KB, MB, GB, TB are powers of 1000; B is bytes"
)
"""The one grammar every size option follows (``--gpu-memory``, ``--host-memory``), quoted in ``--help``.

A plain number means GiB because nobody means 24 bytes of GPU memory; the single letters follow ``free -g``
and container runtimes (binary), and the two-letter SI suffixes are decimal, as disk vendors use them."""

_UNITS = {
    "": 1 << 30,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 1000,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 1000**2,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 1000**3,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_LARGEST = 1 << 60  # an exbibyte: past any machine, and still an exact int64


def parse_size(text: str, *, what: str = "size") -> int:
    """``"24GiB"``, ``"24G"`` and ``"24"`` -> 25769803776; ``"80GB"`` -> 80e9 (see :data:`SIZE_RULE`).

    ``what`` names the option in the error. NaN, infinities, exponents and negative numbers never match."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise UserError(f"{what}: cannot read {text!r} as a size; use e.g. 24 (GiB), 24GiB, 80GB or 512MiB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(f"{what}: size must be positive, got {text!r}")
    if value > _LARGEST:
        raise UserError(f"{what}: {text!r} is larger than any machine ({_LARGEST >> 60} EiB)")
    return value


def format_bytes(n: int | float) -> str:
    """Binary units, one decimal: ``30.1 GiB``, ``512.0 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
