"""The engine's side of a checkpoint: which arrays it holds, read from and restored to where each unit
keeps them.

A checkpoint holds the fp32 master and the optimizer's state arrays (``checkpoint_arrays`` in
optim/state_formats.py, which planners price too). Each is one :class:`StateSource` (for a save) or
:class:`StateSink` (for a resume) over every unit, reading and writing each unit's range where its
pipeline keeps it (host slabs, the GPU, a state tier; state_source.py), so neither needs host memory for
what lives elsewhere. A data-parallel rank's arrays hold its shard of every unit (the pipelines' spans),
and say so (their ``intervals``), which is how the checkpoint records where every rank's elements are and
how a resume at any world size reads its own shards (slide_core/checkpoint/reader.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slide_core.checkpoint import load_checkpoint
from slide_core.optim.state_formats import StateArray, checkpoint_arrays, refuse_other_state_format
from slide_core.optimizer import Optimizer
from slide_core.unit import SlideModel

from .state_source import StateSink, StateSource
from .unit_pipelines import UnitPipelines

__all__ = ["checkpoint_sources", "restore"]


def _arrays(optimizer: Optimizer) -> tuple[StateArray, ...]:
    """The checkpoint's arrays: the fp32 master, then the optimizer's state as it stores it."""
    return checkpoint_arrays(optimizer.state_arrays)


def checkpoint_sources(model: SlideModel, optimizer: Optimizer, pipelines: UnitPipelines) -> dict[str, StateSource]:
    """One :class:`StateSource` per checkpoint array, each this rank's part of every unit (all of it in
    one process), for ``save_checkpoint``. The caller waits for pending updates first."""
    by_name, spans = pipelines.by_name, pipelines.spans
    return {a.name: StateSource(a.name, model.units, by_name, spans, a) for a in _arrays(optimizer)}


def restore(path: Path, model: SlideModel, optimizer: Optimizer, pipelines: UnitPipelines) -> dict[str, Any]:
    """Stream checkpoint ``path`` (any format, written by any number of processes) into this rank's part
    of every unit, block by verified block; return its state. A checkpoint of another optimizer state
    format is refused in one line (``StateFormatMismatch``) before any array moves."""
    refuse_other_state_format(path, optimizer.state_format)
    by_name, spans = pipelines.by_name, pipelines.spans
    sinks = {a.name: StateSink(a.name, model.units, by_name, spans, a) for a in _arrays(optimizer)}
    return load_checkpoint(path, sinks, unit_numels=[unit.layout.numel for unit in model.units])
