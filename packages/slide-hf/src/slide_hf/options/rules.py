"""What one option accepts on its own: a range, a set of choices, or the installed plugins of a group.

A :class:`Rule` checks one value and words the refusal (``must be an integer in [1, 64]``). Rules that
relate several options live in :mod:`slide_hf.options.validate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["FP32_TINY", "INT_MAX", "Rule", "positive_int"]

INT_MAX = 2**63 - 1
"""The largest integer torch and numpy take (a seed past it cannot seed torch)."""
FP32_TINY = 1.1754943508222875e-38
"""The smallest normal fp32 number: an --adam-eps below it rounds to 0 (or a subnormal) in the fp32 update,
and a zero second moment then divides 0 by 0."""


@dataclass(frozen=True)
class Rule:
    """What one option accepts: a finite number in ``[low, high]`` (``low_open``: strictly above ``low``,
    ``high_open``: strictly below ``high``), one of ``choices``, or (kind ``"plugin"``) one of ``choices``
    or a name installed in the entry-point ``group``, read when the value is checked, never hard-coded."""

    kind: str  # "int", "float", "choice" or "plugin"
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()
    group: str | None = None

    def names(self) -> tuple[str, ...]:
        """What a choice or plugin option accepts now: ``choices`` first, then the installed plugins."""
        if self.kind != "plugin" or self.group is None:
            return self.choices
        from slide_core import plugins

        return self.choices + tuple(name for name in plugins.available(self.group) if name not in self.choices)

    def describe(self) -> str:
        """``in [0, 1)``, ``>= 0``, ``an integer in [1, 64]``: interval notation, as the docs write ranges."""
        if self.kind in ("choice", "plugin"):
            return "one of " + ", ".join(self.names())
        noun = "an integer" if self.kind == "int" else "a finite number"
        low, high = self.low, self.high
        if self.kind == "int":
            low, high = (None if low is None else int(low)), (None if high is None else int(high))
        shown_high = high is not None and (self.kind == "float" or high < 2**31)
        if low is not None and high is not None and shown_high:
            opening, closing = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"{noun} in {opening}{_num(low)}, {_num(high)}{closing}"
        if low is not None:
            return f"{noun} {'>' if self.low_open else '>='} {_num(low)}"
        return noun

    def accepts(self, value: Any) -> bool:
        if self.kind in ("choice", "plugin"):  # a listed choice needs no look at the installed plugins
            return isinstance(value, str) and (value in self.choices or value in self.names())
        if isinstance(value, bool):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        if not isinstance(value, int | float) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def out_of_range_word(self, value: Any) -> str:
        """``" (too large)"`` for an integer past a bound the message does not print; for a plugin that is
        not installed but well known, ``"; `nvme` needs slide-io: pip install slide-io"``."""
        if self.kind == "plugin" and self.group is not None and isinstance(value, str):
            from slide_core import plugins

            hint = plugins.install_hint(self.group, value)
            return f"; {hint}" if hint else ""
        big = self.kind == "int" and isinstance(value, int) and self.high is not None and value > self.high
        return " (too large)" if big and self.high is not None and self.high >= 2**31 else ""


def _num(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def positive_int(high: float = INT_MAX) -> Rule:
    return Rule("int", 1, high)
