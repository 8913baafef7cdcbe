"""Progress: a live bar on a terminal, one plain log line per step otherwise."""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["Progress"]

log = logging.getLogger("slide.train")


class Progress:
    """Shows step, loss, tok/s, TFLOPS, eta (hiding factor) and memory. A context manager."""

    def __init__(self, total_steps: int, *, first_step: int = 0, live: bool | None = None) -> None:
        self.total_steps = total_steps
        self.first_step = first_step
        self.live = sys.stderr.isatty() if live is None else live
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(
                "train", total=self.total_steps, completed=self.first_step, status="starting"
            )
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc_info)
            self._progress = None

    def update(self, record: dict[str, Any]) -> None:
        parts = [
            f"loss {record['loss']:.4f}",
            f"{record['tokens_per_s']:,.0f} tok/s",
            f"{record['tflops']:.1f} TFLOPS",
        ]
        if record.get("eta") is not None:
            parts.append(f"eta {record['eta']:.2f}")
        parts.append(f"GPU {record['gpu_mem_peak_gb']:.1f} GB")
        parts.append(f"host {record['host_rss_gb']:.1f} GB")
        status = "  ".join(parts)
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"], status=status)
        else:
            log.info("step %d/%d  lr %.3g  %s", record["step"], self.total_steps, record["lr"], status)
