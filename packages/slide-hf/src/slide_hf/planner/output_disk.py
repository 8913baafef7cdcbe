"""Disk of a run's output directory: its checkpoints and the exported HF model.

One checkpoint is priced by the code that decides what a checkpoint holds (``checkpoint_arrays`` and
``checkpoint_bytes`` in slide_core's optim/state_formats.py, which the engine writes from): the fp32
master and the optimizer's moments as the ``optimizer_state`` option stores them, about 12 B/param in fp32. How
many exist at once follows the retention rule of docs/checkpoints.md (Note [Retention] in slide_core's
checkpoint/retention.py): the newest ``--keep-checkpoints``, the best one when ``--save-best`` keeps an
older one, and the one being written (the previous ones stay until it is published), unless
``--save-delete-first`` deletes the oldest before it writes; none with ``--keep-checkpoints 0``, whose run
ends with the export alone, written from the training state. The export is every parameter once in the
export dtype, and so is each weights-only save (``--save-weights-every``), all of which are kept.

`slide plan` shows these numbers; `slide train` refuses, before loading anything, an output disk that
cannot hold one checkpoint and the export (:func:`check_output_disk`).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slide_core.optim.state_formats import StateArray, checkpoint_arrays, checkpoint_bytes
from slide_hf.errors import UserError
from slide_hf.sizes import format_bytes
from slide_hf.spelling import option

__all__ = [
    "OutputDisk",
    "check_output_disk",
    "checkpoints_at_once",
    "checkpoints_kept",
    "disk_key",
    "free_bytes",
    "output_disk",
    "run_output_disk",
    "weights_saves",
]

if TYPE_CHECKING:
    from slide_hf.options import TrainConfig

log = logging.getLogger("slide.train")


@dataclass(frozen=True)
class OutputDisk:
    """Bytes one checkpoint takes, how many exist at once at most and how many stay after a save, the
    exported model's bytes, and the weights-only saves (each as large as the export) a run makes."""

    checkpoint_bytes: int
    checkpoints_at_once: int
    export_bytes: int
    checkpoints_kept: int = 0
    weights_saves: int = 0

    @property
    def checkpoints_bytes(self) -> int:
        return self.checkpoint_bytes * self.checkpoints_at_once

    @property
    def weights_bytes(self) -> int:
        """Every weights-only save of the run (``--save-weights-every``; none is pruned)."""
        return self.export_bytes * self.weights_saves

    @property
    def total_bytes(self) -> int:
        """The most the run's checkpoints, weights-only saves and export take together."""
        return self.checkpoints_bytes + self.weights_bytes + self.export_bytes

    @property
    def export_only(self) -> bool:
        """``--keep-checkpoints 0``: the run ends with the export alone; only a stop writes a checkpoint."""
        return self.checkpoints_at_once == 0

    @property
    def minimum_bytes(self) -> int:
        """Less than this and the run cannot finish: one checkpoint and the export, or the export alone."""
        return (0 if self.export_only else self.checkpoint_bytes) + self.export_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "checkpoints_bytes": self.checkpoints_bytes,
            "weights_bytes": self.weights_bytes,
            "total_bytes": self.total_bytes,
        }


def checkpoints_kept(keep_checkpoints: int, save_best: bool) -> int:
    """How many checkpoints stay once a save is published and pruned: the newest ``keep_checkpoints``
    and, with ``save_best``, the best one when it is older than those."""
    return keep_checkpoints + int(save_best)


def checkpoints_at_once(keep_checkpoints: int, save_best: bool, delete_first: bool = False) -> int:
    """The most that exist at once: those kept, and the one being written unless ``delete_first`` made
    room for it first; none when ``keep_checkpoints`` is 0 (the run ends with the export alone)."""
    if keep_checkpoints == 0:
        return 0
    return checkpoints_kept(keep_checkpoints, save_best) + int(not delete_first)


def weights_saves(total_steps: int | None, save_weights_every: int) -> int:
    """How many weights-only saves a run of ``total_steps`` makes: one every ``save_weights_every`` steps,
    but none at the last step, whose weights are the exported model. 0 when the step count is unknown."""
    if not total_steps or save_weights_every <= 0:
        return 0
    return (total_steps - 1) // save_weights_every


def output_disk(
    unit_numels: Sequence[int],
    state: Sequence[StateArray],
    *,
    params: int,
    export_itemsize: int,
    keep_checkpoints: int,
    save_best: bool,
    delete_first: bool = False,
    save_weights_every: int = 0,
    total_steps: int | None = None,
) -> OutputDisk:
    """The output disk of a run of units of ``unit_numels`` whose optimizer keeps ``state`` arrays,
    exporting ``params`` parameters of ``export_itemsize`` bytes, with the checkpoint options of
    `slide train` (``delete_first`` is ``--save-delete-first``) and, when its step count is known,
    ``total_steps`` for the weights-only saves."""
    return OutputDisk(
        checkpoint_bytes(checkpoint_arrays(state), unit_numels),
        checkpoints_at_once(keep_checkpoints, save_best, delete_first),
        params * export_itemsize,
        checkpoints_kept(keep_checkpoints, save_best),
        weights_saves(total_steps, save_weights_every),
    )


def run_output_disk(
    cfg: TrainConfig,
    unit_numels: Sequence[int],
    state: Sequence[StateArray],
    *,
    params: int,
    export_itemsize: int,
    total_steps: int | None = None,
) -> OutputDisk:
    """:func:`output_disk` with the checkpoint options of ``cfg`` (--keep-checkpoints, --save-best,
    --save-delete-first, --save-weights-every), so `slide plan` and `slide train` price the same run alike.
    ``total_steps``: the run's step count when known (else ``cfg.steps``), for the weights-only saves."""
    return output_disk(
        unit_numels,
        state,
        params=params,
        export_itemsize=export_itemsize,
        keep_checkpoints=cfg.keep_checkpoints,
        save_best=cfg.save_best,
        delete_first=cfg.save_delete_first,
        save_weights_every=cfg.save_weights_every,
        total_steps=total_steps if total_steps is not None else cfg.steps,
    )


def _nearest_existing(directory: Path) -> Path:
    path = Path(directory).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(directory: Path) -> int:
    """Free bytes on the file system of ``directory`` (its nearest existing ancestor) for this user."""
    return shutil.disk_usage(_nearest_existing(directory)).free


def disk_key(directory: Path) -> str:
    """The mount point of the file system ``directory`` (its nearest existing ancestor) is on: what a
    measured checkpoint write rate is kept under (slide_hf/in_step_rates.py)."""
    path = _nearest_existing(directory).resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return str(path)


def check_output_disk(directory: Path, need: OutputDisk) -> None:
    """Refuse in one line an output disk that cannot hold one checkpoint and the export (the export alone
    with ``--keep-checkpoints 0``); warn when it holds that but not every checkpoint the retention keeps at
    once, or, exporting alone, not the checkpoint a stop would write."""
    free = free_bytes(directory)
    if need.export_only:
        if free < need.export_bytes + need.weights_bytes:
            raise UserError(
                f"the disk of {directory} has {format_bytes(free)} free, but the exported model takes "
                f"{format_bytes(need.export_bytes)}{_weights_clause(need)}; free space there or choose another "
                f"{option('output')}"
            )
        if free < need.checkpoint_bytes + need.export_bytes:
            log.warning(
                "the disk of %s has %s free: enough for the %s export, not for the %s checkpoint a stop "
                "(SIGINT/SIGTERM) or a failed export writes to resume from",
                directory,
                format_bytes(free),
                format_bytes(need.export_bytes),
                format_bytes(need.checkpoint_bytes),
            )
        return
    if free < need.minimum_bytes:
        raise UserError(
            f"the disk of {directory} has {format_bytes(free)} free, but one checkpoint takes "
            f"{format_bytes(need.checkpoint_bytes)} and the exported model {format_bytes(need.export_bytes)}; "
            f"free space there or choose another {option('output')}"
        )
    if free < need.total_bytes:
        weights = f", {need.weights_saves} weights-only saves" if need.weights_saves else ""
        log.warning(
            "the disk of %s has %s free; up to %d checkpoints of %s%s and the %s export may exist at once (%s): "
            "lower %s, use %s or free space before the later saves fail",
            directory,
            format_bytes(free),
            need.checkpoints_at_once,
            format_bytes(need.checkpoint_bytes),
            weights,
            format_bytes(need.export_bytes),
            format_bytes(need.total_bytes),
            option("keep_checkpoints"),
            option("save_delete_first"),
        )


def _weights_clause(need: OutputDisk) -> str:
    if not need.weights_saves:
        return ""
    return f" and {need.weights_saves} weights-only saves {format_bytes(need.weights_bytes)}"
