"""Progress: a live bar on a terminal, plain log lines otherwise (nohup, SLURM, notebooks).

Both say the same things with labels: loss, tokens per second (tokens that are not padding), the time
remaining as ``ETA 1:42:10``, and the overlap (how much of the gradient transfer and host update hides
behind the backward; >= 1 means all of it -- a ratio, not a time). GPU memory and TFLOPS appear only when
the run has a GPU.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from typing import Any

__all__ = ["Progress", "format_duration"]

log = logging.getLogger("slide.train")


def format_duration(seconds: float) -> str:
    """``6130`` -> ``1:42:10``; ``75`` -> ``1:15``."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Step progress with a labeled time remaining. A context manager.

    The time remaining is the mean of the last ``window`` steps' wall times (evaluation included, since
    the user waits for it too) times the steps left; the first step, which compiles and warms caches, is
    left out once there is a second."""

    def __init__(
        self,
        total_steps: int,
        *,
        first_step: int = 0,
        live: bool | None = None,
        has_gpu: bool = True,
        log_every: int = 1,
        window: int = 20,
    ) -> None:
        self.total_steps = total_steps
        self.first_step = first_step
        self.live = sys.stderr.isatty() if live is None else live
        self.has_gpu = has_gpu
        self.log_every = log_every
        self._durations: deque[float] = deque(maxlen=window)
        self._last_mark: float | None = None
        self._steps_seen = 0
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        self._last_mark = time.perf_counter()
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
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

    def seconds_remaining(self, step: int) -> float | None:
        """The estimate shown as ETA after ``step`` steps are done (None before the first step)."""
        if not self._durations:
            return None
        times = list(self._durations)
        if len(times) > 1 and self._steps_seen <= self._durations.maxlen:
            times = times[1:]  # the first step compiles and warms caches
        return sum(times) / len(times) * max(0, self.total_steps - step)

    def update(self, record: dict[str, Any]) -> str:
        """Show one step's record; returns the status text (also what the log line carries)."""
        now = time.perf_counter()
        if self._last_mark is not None:
            self._durations.append(now - self._last_mark)
        self._last_mark = now
        self._steps_seen += 1
        step = record["step"]
        remaining = self.seconds_remaining(step)
        record["eta_s"] = remaining
        parts = [f"loss {record['loss']:.4f}"]
        if record.get("grad_norm") is not None:
            parts.append(f"grad norm {record['grad_norm']:.3g}")
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
        if self.has_gpu:
            parts.append(f"{record['tflops']:.1f} TFLOPS")
        if record.get("overlap") is not None:
            parts.append(f"overlap {record['overlap']:.2f}")
        if self.has_gpu:
            parts.append(f"GPU {record['gpu_mem_peak_gb']:.1f} GB")
        parts.append(f"host {record['host_rss_gb']:.1f} GB")
        if remaining is not None:
            parts.append(f"ETA {format_duration(remaining)}")
        status = "  ".join(parts)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=status)
        elif step % self.log_every == 0 or step == self.total_steps:
            log.info("step %d/%d  lr %.3g  %s", step, self.total_steps, record["lr"], status)
        return status

    def evaluation(self, record: dict[str, Any]) -> None:
        """One evaluation's line (always logged: it is what a user compares checkpoints by)."""
        line = (
            f"eval at step {record['step']}: eval_loss {record['eval_loss']:.4f}  perplexity {record['perplexity']:.4g}"
        )
        if self._progress is not None:
            self._progress.console.log(line)
        log.info(line)
