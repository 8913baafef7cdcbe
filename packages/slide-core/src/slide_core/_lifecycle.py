"""Open/close lifecycle shared by devices and tiers.

Resources (streams, threads, files, pinned pools) are created in ``open`` and released in ``close``, never
at construction, import or garbage collection; ``close`` is safe to call twice, and ``with obj:`` does
both.
"""

from __future__ import annotations

from typing import Self

__all__ = ["Lifecycle"]


class Lifecycle:
    """Mixin: ``open``/``close``/context manager around ``_open_resources``/``_close_resources``."""

    _open: bool = False

    def open(self) -> Self:
        if not self._open:
            self._open_resources()
            self._open = True
        return self

    def close(self) -> None:
        if self._open:
            self._open = False
            self._close_resources()

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def is_open(self) -> bool:
        return self._open

    def _open_resources(self) -> None:
        """Create what the object owns. Called once by ``open``."""

    def _close_resources(self) -> None:
        """Drain in-flight work and release what the object owns. Called once by ``close``."""
