"""The run against its plan: what `slide train` measured beside what its plan said, said once at the end.

A plan is a promise made before a user spends the GPU time; the run's own log is where that promise is
checked, term by term, so a user sees how far the plan of this machine is off (and `slide plan` on the next
run can be read with that in mind). The step is the median wall time of the steps after the first (the
first compiles kernels and fills the caches); the host peak is the process's peak resident memory as the
kernel counts it (``ru_maxrss``), the GPU peak the device allocator's.
"""

from __future__ import annotations

import resource
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slide_hf.in_step_rates import MeasuredTerms

__all__ = ["PlanCheck", "host_peak_rss_bytes"]

GiB = 1 << 30


def host_peak_rss_bytes() -> int:
    """This process's peak resident memory so far (no sampling: the kernel keeps it)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


@dataclass(frozen=True)
class PlanCheck:
    """Measured and planned, per term: seconds per step, host peak bytes, GPU peak bytes (None: no GPU)."""

    step_s: float | None
    planned_step_s: float | None
    host_peak_bytes: int
    planned_host_peak_bytes: int
    gpu_peak_bytes: int | None
    planned_gpu_peak_bytes: int | None
    terms: MeasuredTerms | None = None
    host_buffers_bytes: int | None = None
    """What the engine allocated for its host buffers (``Engine.host_allocations``), beside the plan's buffers."""
    planned_host_buffers_bytes: int | None = None
    """The step's terms (GPU compute, host AdamW busy) measured beside the plan's (slide_hf/in_step_rates.py)."""

    @classmethod
    def of(
        cls,
        plan: Any,
        step_times_s: Sequence[float],
        *,
        gpu_peak_bytes: int | None,
        terms: MeasuredTerms | None = None,
        host_buffers_bytes: int | None = None,
        world_size: int = 1,
        grad_norms: Sequence[float | None] = (),
        max_grad_norm: float = 0.0,
        extra_host_bytes: int = 0,
    ) -> PlanCheck:
        """``plan``: the run's placed plan; ``step_times_s``: every step's wall time, in order;
        ``gpu_peak_bytes``: the device's peak, None on the CPU device. The CPU device has no step time in
        its plan (the planner's rates are a GPU's and its PCIe link's), so only its host peak is compared.
        ``grad_norms``: each step's gradient norm, in order, with clipping at ``max_grad_norm``: a step
        after one that clipped is compared with the plan's deferred step (``Plan.expected_step_s``).
        ``extra_host_bytes``: host memory the run holds beside the engine's, planned outside ``plan`` (a
        background save's copy, slide_hf/planner/save_cost.py)."""
        warm = list(step_times_s[1:]) or list(step_times_s)
        on_gpu = gpu_peak_bytes is not None
        planned_step_s = plan.step_time_s
        if max_grad_norm > 0 and grad_norms:
            norm_before = [None, *grad_norms[:-1]]  # the norm of the step before each step
            planned_step_s = plan.expected_step_s(norm_before[1:] or norm_before, max_grad_norm)
        return cls(
            step_s=statistics.median(warm) if warm and on_gpu else None,
            planned_step_s=planned_step_s if on_gpu else None,
            host_peak_bytes=host_peak_rss_bytes(),
            planned_host_peak_bytes=plan.host_peak_bytes + extra_host_bytes,
            gpu_peak_bytes=gpu_peak_bytes,
            planned_gpu_peak_bytes=None if gpu_peak_bytes is None else plan.gpu_peak_bytes,
            terms=terms if on_gpu else None,
            host_buffers_bytes=host_buffers_bytes,
            planned_host_buffers_bytes=_planned_host_buffers(plan, world_size)
            if host_buffers_bytes is not None
            else None,
        )

    def to_dict(self) -> dict[str, dict[str, float | None]]:
        """Each term as ``{measured, planned, ratio}`` (ratio: measured / planned)."""
        terms = {
            "step_s": (self.step_s, self.planned_step_s),
            "host_peak_bytes": (self.host_peak_bytes, self.planned_host_peak_bytes),
            "gpu_peak_bytes": (self.gpu_peak_bytes, self.planned_gpu_peak_bytes),
            "host_buffers_bytes": (self.host_buffers_bytes, self.planned_host_buffers_bytes),
        }
        measured_terms = {
            name: _term(measured, planned) for name, (measured, planned) in terms.items() if measured is not None
        }
        return measured_terms | (self.terms.to_dict() if self.terms is not None else {})

    def line(self) -> str:
        """One log line: ``measured against planned: step 1.23 s / 1.10 s (x1.12), host peak ...``."""
        parts = []
        if self.step_s is not None and self.planned_step_s is not None:
            parts.append(
                f"step {self.step_s:.3g} s / {self.planned_step_s:.3g} s{_ratio(self.step_s, self.planned_step_s)}"
            )
        parts.append(
            f"host peak {self.host_peak_bytes / GiB:.2f} / {self.planned_host_peak_bytes / GiB:.2f} GiB"
            f"{_ratio(self.host_peak_bytes, self.planned_host_peak_bytes)}"
        )
        if self.host_buffers_bytes is not None and self.planned_host_buffers_bytes:
            parts.append(
                f"host buffers {self.host_buffers_bytes / GiB:.2f} / {self.planned_host_buffers_bytes / GiB:.2f} GiB"
                f"{_ratio(self.host_buffers_bytes, self.planned_host_buffers_bytes)}"
            )
        if self.gpu_peak_bytes is not None and self.planned_gpu_peak_bytes is not None:
            parts.append(
                f"GPU peak {self.gpu_peak_bytes / GiB:.2f} / {self.planned_gpu_peak_bytes / GiB:.2f} GiB"
                f"{_ratio(self.gpu_peak_bytes, self.planned_gpu_peak_bytes)}"
            )
        if self.terms is not None and self.terms.line():
            parts.append(self.terms.line())
        return "measured against planned: " + ", ".join(parts)


def _planned_host_buffers(plan: Any, world_size: int) -> int:
    """The host bytes of the buffers one rank's engine allocates, as the plan prices them (the largest rank's)."""
    from slide_hf.planner.memory import engine_buffers

    return sum(engine_buffers(plan.shape, plan.inputs, world_size).host.values())


def _term(measured: float, planned: float | None) -> dict[str, float | None]:
    ratio = measured / planned if planned else None
    return {"measured": measured, "planned": planned, "ratio": ratio}


def _ratio(measured: float, planned: float) -> str:
    return f" (x{measured / planned:.2f})" if planned > 0 else ""
