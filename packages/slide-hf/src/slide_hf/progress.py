"""Progress: a live bar on a terminal, plain log lines otherwise (nohup, SLURM, notebooks).

Both say the same things with labels: loss, tokens per second (tokens that are not padding), the time
remaining as ``ETA 1:42:10``, and the overlap (how much of the gradient transfer and host update hides
behind the backward; >= 1 means all of it -- a ratio, not a time). GPU memory and TFLOPS appear only when
the run has a GPU.

The live line is fitted to the terminal's width on every update (a resized terminal included): the step
counter and the time remaining always stay, then the loss and the throughput; the other fields go first,
and the bar narrows, rather than letting the terminal crop the line's end.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from typing import Any

__all__ = ["PassProgress", "Progress", "fit_fields", "format_duration"]

log = logging.getLogger("slide.train")

_LABEL = "train"
_KEEP_ORDER = ("step", "eta", "loss", "reward acc", "margin", "tok/s", "grad norm", "overlap", "TFLOPS", "GPU", "host")
"""Which fields a narrow line keeps, most important first (they are shown in the line's own order)."""


def format_duration(seconds: float) -> str:
    """``6130`` -> ``1:42:10``; ``75`` -> ``1:15``."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def fit_fields(fields: list[tuple[str, str]], room: int) -> str:
    """The ``(key, text)`` fields joined by two spaces in their order, leaving out the least important
    (by ``_KEEP_ORDER``) until the line is at most ``room`` characters; the first kept field is never
    dropped."""
    rank = {key: i for i, key in enumerate(_KEEP_ORDER)}
    kept = list(fields)
    by_importance = sorted(kept, key=lambda field: rank.get(field[0], len(rank)))
    while len(kept) > 1 and len("  ".join(text for _, text in kept)) > room:
        kept.remove(by_importance.pop())
    return "  ".join(text for _, text in kept)


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
        console: Any = None,
    ) -> None:
        """``console``: the rich console of the live line (default: stderr's), e.g. a fixed-width one."""
        self.total_steps = total_steps
        self.first_step = first_step
        self.live = sys.stderr.isatty() if live is None else live
        self.has_gpu = has_gpu
        self.log_every = log_every
        self._window = window
        self._durations: deque[float] = deque(maxlen=window)
        self._last_mark: float | None = None
        self._steps_seen = 0
        self._progress: Any = None
        self._task: Any = None
        self._bar: Any = None
        self._console = console

    def __enter__(self) -> Progress:
        self._last_mark = time.perf_counter()
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn

            self._bar = BarColumn()
            self._progress = Progress(
                TextColumn(f"[bold]{_LABEL}"),
                self._bar,
                TextColumn("{task.fields[status]}"),
                transient=False,
                console=self._console,
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
        if len(times) > 1 and self._steps_seen <= self._window:
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
        fields = self._fields(record, remaining)
        status = "  ".join(text for _, text in fields)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=self._fit(step, fields))
        elif step % self.log_every == 0 or step == self.total_steps:
            log.info("step %d/%d  lr %.3g  %s", step, self.total_steps, record["lr"], status)
        return status

    def _fields(self, record: dict[str, Any], remaining: float | None) -> list[tuple[str, str]]:
        """``(key, text)`` of each field of the status, in the line's order (keys as in ``_KEEP_ORDER``)."""
        fields = [("loss", f"loss {record['loss']:.4f}")]
        if record.get("rewards/accuracies") is not None:  # a preference run (docs/preference.md)
            fields.append(("reward acc", f"reward acc {record['rewards/accuracies']:.2f}"))
            fields.append(("margin", f"margin {record['rewards/margins']:.3g}"))
        if record.get("grad_norm") is not None:
            fields.append(("grad norm", f"grad norm {record['grad_norm']:.3g}"))
        fields.append(("tok/s", f"{record['tokens_per_s']:,.0f} tok/s"))
        if self.has_gpu:
            fields.append(("TFLOPS", f"{record['tflops']:.1f} TFLOPS"))
        if record.get("overlap") is not None:
            fields.append(("overlap", f"overlap {record['overlap']:.2f}"))
        if self.has_gpu:
            fields.append(("GPU", f"GPU {record['gpu_mem_peak_gb']:.1f} GB"))
        fields.append(("host", f"host {record['host_rss_gb']:.1f} GB"))
        if remaining is not None:
            fields.append(("eta", f"ETA {format_duration(remaining)}"))
        return fields

    def _fit(self, step: int, fields: list[tuple[str, str]]) -> str:
        """The live status for the console's width now: the bar takes a fifth of the width (5 to 40
        columns), and fields are dropped least important first until the line fits."""
        width = self._progress.console.width
        bar = min(40, max(5, width // 5))
        self._bar.bar_width = bar
        room = width - len(_LABEL) - bar - 3  # two column gaps, and one spare column
        return fit_fields([("step", f"{step}/{self.total_steps}"), *fields], room)

    def evaluation(self, record: dict[str, Any]) -> None:
        """One evaluation's line (always logged: it is what a user compares checkpoints by): SFT's with its
        perplexity, a preference run's with its held-out pairs' reward accuracy and margin."""
        line = f"eval at step {record['step']}: eval_loss {record['eval_loss']:.4f}"
        if record.get("perplexity") is not None:
            line += f"  perplexity {record['perplexity']:.4g}"
        if record.get("eval_rewards/accuracies") is not None:  # a preference run (docs/preference.md)
            line += f"  reward acc {record['eval_rewards/accuracies']:.2f}  margin {record['eval_rewards/margins']:.3g}"
        log.info(line)  # as every other line: no timestamp or source link, and once (the live bar stays below)


class PassProgress:
    """Progress of a pass over ``total`` micro-batches before training (DPO's reference pass): a live bar on
    a terminal, else a labeled log line at every tenth and at the end, each with the time remaining (the
    mean time per micro-batch so far times those left). A context manager."""

    def __init__(self, label: str, total: int, *, live: bool | None = None, console: Any = None) -> None:
        self.label = label
        self.total = total
        self.live = sys.stderr.isatty() if live is None else live
        self._console = console
        self._started = 0.0
        self._next_line = 0
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> PassProgress:
        self._started = time.perf_counter()
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn(f"[bold]{self.label}"),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                transient=False,
                console=self._console,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(self.label, total=self.total, status="starting")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc_info)
            self._progress = None

    def seconds_remaining(self, done: int) -> float:
        elapsed = time.perf_counter() - self._started
        return elapsed / max(done, 1) * max(0, self.total - done)

    def update(self, done: int) -> str:
        """``done`` of the micro-batches are through; returns the status text."""
        status = f"{done}/{self.total} micro-batches  ETA {format_duration(self.seconds_remaining(done))}"
        if self._progress is not None:
            self._progress.update(self._task, completed=done, status=status)
        elif done >= self._next_line or done == self.total:
            log.info("%s: %s", self.label, status)
            self._next_line = done + max(1, -(-self.total // 10))
        return status
