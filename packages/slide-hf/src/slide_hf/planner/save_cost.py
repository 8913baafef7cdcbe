"""What a resumable checkpoint costs the training loop: how long a save holds it up, and with
``--save-async`` the host memory of the copy it writes from.

A save in the foreground holds the loop for the whole write, one checkpoint's bytes at the disk's rate. A
background save (``--save-async``, Note [Background snapshot] in slide_core's checkpoint/background.py)
holds it only for a copy of the master and optimizer state in host memory; the write goes on while
training does. From the second save on that copy lands in the buffers the first one left
(Note [Snapshot buffers are kept]), a memory-to-memory copy: one read and one write of each byte at the
host's memory bandwidth. The first save also maps that memory, which the kernel does page by page and
which runs several times slower (measured in docs/benchmarks.md); the pause priced here is the steady
one. The buffers stay held to the end of the run, so the run's host peak grows by one checkpoint: where
the host does not have that beside the run's own peak, the run writes each save in the foreground instead
(with a warning), and so the plan prices the foreground pause for it.

The write is priced at the rate a run measured writing a checkpoint on the output's file system
(slide_hf/in_step_rates.py: every save in the foreground measures it), else at the planner's disk rate,
which the line calls assumed: `slide doctor` does not measure the output disk.

`slide plan` shows these numbers, and `slide train` logs them and warns at the start when a background
save cannot fit (slide_hf/recipe.py), both from :func:`save_cost`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from slide_hf.planner.inputs import Bandwidths
from slide_hf.planner.output_disk import OutputDisk
from slide_hf.sizes import format_bytes
from slide_hf.spelling import option

__all__ = ["SaveCost", "save_cost"]


@dataclass(frozen=True)
class SaveCost:
    """One checkpoint save of a run: ``checkpoint_bytes`` written; ``background`` when ``--save-async``
    was asked; ``copy_fits`` whether the copy fits the host beside ``run_host_peak_bytes``, the run's peak
    without it (True when the host is unknown); the write at ``disk_gbps`` (``write_measured``: a rate a
    run measured writing a checkpoint on this disk, else the planner's assumed disk rate); the copy at
    ``host_mem_gbps``."""

    checkpoint_bytes: int
    background: bool
    copy_fits: bool
    run_host_peak_bytes: int
    disk_gbps: float
    host_mem_gbps: float
    write_measured: bool = False

    @property
    def in_background(self) -> bool:
        """Whether saves are written in the background: asked for, and the copy fits."""
        return self.background and self.copy_fits

    @property
    def copy_bytes(self) -> int:
        """Host memory held for the copy from the first save on (0 in the foreground)."""
        return self.checkpoint_bytes if self.in_background else 0

    @property
    def host_peak_bytes(self) -> int:
        """The run's host peak with the copy held where it is."""
        return self.run_host_peak_bytes + self.copy_bytes

    @property
    def write_s(self) -> float:
        """Writing one checkpoint to the disk."""
        return self.checkpoint_bytes / (self.disk_gbps * 1e9)

    @property
    def copy_s(self) -> float:
        """Copying one checkpoint into the kept buffers: each byte read once and written once."""
        return 2 * self.checkpoint_bytes / (self.host_mem_gbps * 1e9)

    @property
    def pause_s(self) -> float:
        """How long one save holds the training loop up."""
        return self.copy_s if self.in_background else self.write_s

    def to_dict(self) -> dict[str, Any]:
        derived = ("in_background", "copy_bytes", "host_peak_bytes", "write_s", "copy_s", "pause_s")
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}

    def describe(self) -> str:
        """One line for the run's log: the pause, then :meth:`why`."""
        return f"each checkpoint save pauses training {self.pause_s:.3g} s: {self.why()}"

    def why(self) -> str:
        """What the pause is (a write or a copy) and what else the save costs; `slide plan`'s row."""
        size = format_bytes(self.checkpoint_bytes)
        rate = (
            "measured by a save on this disk"
            if self.write_measured
            else "assumed until a save on this disk is measured"
        )
        writing = f"writing {size} at {self.disk_gbps:.3g} GB/s, {rate}"
        if self.in_background:
            return (
                f"a copy of {size} at host memory speed (the first save also maps it, slower); {writing} "
                f"(~{self.write_s:.3g} s), goes on while training does"
            )
        if self.background:
            return (
                f"{writing}; {option('save_async')}'s copy of {size} does not fit beside the run's host peak, "
                "so each save is written in the foreground"
            )
        return f"{writing}; {option('save_async')} would pause for a copy instead, holding {size} of host RAM"


def save_cost(
    outputs: OutputDisk,
    *,
    background: bool,
    host_peak_bytes: int,
    host_available: int | None,
    bandwidths: Bandwidths,
    write_gbps: float | None = None,
) -> SaveCost:
    """The cost of one save of a run whose checkpoints ``outputs`` prices (slide_hf/planner/output_disk.py),
    whose host peak without a copy is ``host_peak_bytes``, on a host with ``host_available`` bytes for the
    run (None: not checked), at ``bandwidths``'s host memory rate and ``write_gbps`` (a checkpoint write
    a run measured on the output's disk, slide_hf/in_step_rates.py), else ``bandwidths``'s disk rate."""
    nbytes = outputs.checkpoint_bytes
    return SaveCost(
        checkpoint_bytes=nbytes,
        background=background,
        copy_fits=host_available is None or host_peak_bytes + nbytes <= host_available,
        run_host_peak_bytes=host_peak_bytes,
        disk_gbps=write_gbps if write_gbps is not None else bandwidths.disk_gbps,
        host_mem_gbps=bandwidths.host_mem_gbps,
        write_measured=write_gbps is not None,
    )
