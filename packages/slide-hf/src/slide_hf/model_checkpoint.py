"""Which checkpoint a run's ``model/`` is the export of, and how that checkpoint's weights come back.

A run's ``model/`` holds the weights of its last step, unless the run kept its best checkpoint
(``--save-best``) and that one is older: then ``model/`` holds the best checkpoint's weights, as the HF
Trainer's ``load_best_model_at_end`` does, and the last step's checkpoint stays in ``checkpoints/`` for a
resume. Three places need to agree on that, so they share :func:`model_checkpoint`: `slide train`'s export
at the end of the run, `slide export RUN OUT` (which writes the same model the run wrote), and the push of
a finished run's ``model/`` (which checks that ``model/`` is that export).

``checkpoints/best.json`` names the best checkpoint (:func:`read_best`); whether the run kept one is what
its newest checkpoint's options say (``save_best``), so a run resumed without ``--save-best`` exports its
newest checkpoint again, whatever an older ``best.json`` names.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slide_core.checkpoint import CheckpointCorrupt, find_latest, load_checkpoint, read_state
from slide_core.host_params import HostParameters
from slide_hf.errors import UserError
from slide_hf.run_dir import run_of
from slide_hf.spelling import option

__all__ = ["BEST_FILE", "ModelCheckpoint", "load_best_for_export", "load_master", "model_checkpoint", "read_best"]

log = logging.getLogger("slide.train")

BEST_FILE = "best.json"
"""In a run's ``checkpoints/``: the checkpoint with the lowest eval loss (``--save-best``)."""


@dataclass(frozen=True)
class ModelCheckpoint:
    """The checkpoint a run's ``model/`` is the export of: ``eval_loss`` is set when it is the best one."""

    path: Path
    step: int
    eval_loss: float | None = None

    @property
    def is_best(self) -> bool:
        return self.eval_loss is not None

    def describe(self) -> str:
        """``the run's newest checkpoint (step 6)``, or its best one with the eval loss that made it so."""
        if self.eval_loss is None:
            return f"the run's newest checkpoint (step {self.step})"
        return f"the run's best checkpoint (step {self.step}, eval loss {self.eval_loss:.4f}: --save-best)"


def read_best(output: Path) -> dict[str, Any]:
    """``best.json`` of the run in ``output``, its path relative to ``output`` (so the run directory may be
    moved and resumed from anywhere); {} when it is missing, unreadable or names no checkpoint. Files
    written before the path was relative (relative to where that run started) are read by the
    checkpoint's name."""
    try:
        best = json.loads((output / "checkpoints" / BEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not (isinstance(best, dict) and isinstance(best.get("eval_loss"), int | float) and "path" in best):
        return {}
    saved, root = Path(str(best["path"])), output.resolve()
    for candidate in (output / saved, output / "checkpoints" / saved.name):
        if candidate.is_dir() and candidate.resolve().is_relative_to(root):
            return {**best, "path": str(candidate.resolve().relative_to(root))}
    return {}


def model_checkpoint(run: Path) -> ModelCheckpoint:
    """The checkpoint run directory ``run``'s ``model/`` is (or is to be) the export of (``run`` may also be
    its ``checkpoints/`` folder, or name one checkpoint, which is then the answer): the best one when
    the run's newest checkpoint was written with ``--save-best`` and ``best.json`` names an older checkpoint
    that exists, else the newest. Raises ``CheckpointCorrupt`` when there is no checkpoint or a state.json
    is damaged."""
    newest = find_latest(run)
    state = read_state(newest)
    config = state["extra"].get("config")
    if newest == run or not (isinstance(config, dict) and config.get("save_best") is True):
        return ModelCheckpoint(newest, int(state["step"]))
    root = run_of(newest)
    best = read_best(root)
    if not best or (root / best["path"]).resolve() == newest.resolve():
        return ModelCheckpoint(newest, int(state["step"]))
    path = root / best["path"]
    return ModelCheckpoint(path, int(read_state(path)["step"]), float(best["eval_loss"]))


class _MasterSink:
    """A checkpoint's ``master`` array landing in a :class:`HostParameters` of either format: each verified
    block goes to the units it covers, through :meth:`HostParameters.write` (which encodes a split master
    exactly), so no second copy of the model is made."""

    def __init__(self, host: HostParameters) -> None:
        self.host = host
        self.numel = host.numel
        self.dtype = torch.float32
        self._units = [(host.offset(unit), unit) for unit in host.model.units]

    def write_from(self, start: int, block: torch.Tensor) -> None:
        end = start + block.numel()
        for offset, unit in self._units:
            lo, hi = max(start, offset), min(end, offset + unit.layout.numel)
            if lo < hi:
                self.host.write(unit, block[lo - start : hi - start], lo - offset)


def load_master(checkpoint: Path, host: HostParameters) -> dict[str, Any]:
    """Replace ``host``'s master with checkpoint ``checkpoint``'s (verified block by block, from any number
    of processes' shards); return its state. Raises ``CheckpointCorrupt``, naming a checkpoint of another
    model by its element count."""
    numels = [unit.layout.numel for unit in host.model.units]
    return load_checkpoint(checkpoint, {"master": _MasterSink(host)}, unit_numels=numels)


def load_best_for_export(host: HostParameters, run: Path, best: dict[str, Any], final_step: int) -> int:
    """At the end of a ``--save-best`` run: when ``best`` (the run's published best, as ``best.json`` holds
    it) is older than ``final_step``, put its weights into ``host`` (the last step's master, no longer
    needed: its checkpoint is saved) and say so in one line; return the step whose weights ``host`` now
    holds, the one the export is of."""
    if not best.get("path") or best.get("step") == final_step:
        return final_step
    path = run / best["path"]
    try:
        step = int(load_master(path, host)["step"])
    except CheckpointCorrupt as error:
        raise UserError(f"{error}; the run's checkpoints are kept, the last one in {run / 'checkpoints'}") from None
    log.info(
        "%s: %s holds the best checkpoint, step %d (eval loss %.4f), not the last step's weights; the "
        "checkpoint of step %d stays in %s",
        option("save_best"),
        run / "model",
        step,
        best["eval_loss"],
        final_step,
        run / "checkpoints",
    )
    return step
