"""A run's model export, as `slide train` ends and as `slide export` redoes it from a checkpoint.

The export is the last step of a run and the one most exposed to a full disk (it writes the whole model
at once) or to a SIGTERM from a scheduler. `slide train` therefore writes its final checkpoint first;
the export then either publishes a complete model directory or fails with one line that says the
checkpoint is kept and gives the command that finishes the job (``slide export RUN RUN/model``), and
leaves no temporary directory behind.

Note [Export only]: with ``--keep-checkpoints 0`` the run's end writes no checkpoint, for a disk that
holds the export but not the fp32 master and moments (an 8B run's checkpoint is several times its bf16
export). The export is then read from the training state, unit by unit like a weights-only save, while
the engine still runs: so when it cannot finish (a full disk, a signal) nothing is lost yet, and the
state it could not write goes to a checkpoint instead (``keep``), which the message then points to, as
it does for a run that checkpointed first. Only when that checkpoint cannot be written either is the
step's training lost, and the message says so.

A run's weights-only saves (``--save-weights-every``, :func:`export_weights`) are the same export made
mid-run into ``<output>/weights/step-NNNNNNNN``: the weights of that step, without optimizer state, read
unit by unit from wherever the engine keeps each master (the master array of a checkpoint, an
``ArraySource``), so they need one unit's fp32 copy of host memory, not the whole model's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from slide_hf.errors import Interrupted, RunStopped, UserError
from slide_hf.export import ExportCancelled, NonFiniteWeights, export_hf

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from slide_core.checkpoint import ArraySource
    from slide_core.host_params import HostParameters
    from slide_core.unit import SlideModel

__all__ = [
    "WEIGHTS_DIR",
    "StopSignal",
    "export_model",
    "export_run_model",
    "export_weights",
    "set_aside_weights",
    "streamed_master",
    "weights_dir",
    "write_error",
]

WEIGHTS_DIR = "weights"
"""Where a run's weights-only saves go, one HF model directory per step (``weights/step-NNNNNNNN``)."""


class StopSignal(Protocol):
    """What the export needs from a run's signal handling: the signal asked for, if any."""

    @property
    def requested(self) -> str | None: ...

    @property
    def exit_code(self) -> int: ...


def write_error(target: Path, error: OSError) -> str:
    """``cannot write the model to X: No space left on device`` (the system's words for ``error``)."""
    reason = error.strerror or (os.strerror(error.errno) if error.errno else str(error))
    return f"cannot write the model to {target}: {reason}"


def export_model(
    model: SlideModel,
    host: HostParameters,
    config: PreTrainedConfig,
    target: Path,
    *,
    dtype: torch.dtype | None,
    tokenizer_dir: Path | None,
    overwrite: bool = False,
    cancel: Any = None,
) -> Path:
    """:func:`~slide_hf.export.export_hf` with every failure a user can meet as a one-line :class:`UserError`
    (``ExportCancelled`` and interrupts pass through for the caller to report)."""
    try:
        return export_hf(
            model, host, config, target, dtype=dtype, tokenizer_dir=tokenizer_dir, overwrite=overwrite, cancel=cancel
        )
    except FileExistsError:
        raise UserError(f"{target} already exists; choose an output directory that does not exist yet") from None
    except NonFiniteWeights as error:
        raise UserError(f"cannot export {target}: {error}") from None
    except OSError as error:
        raise UserError(write_error(target, error)) from None


def export_run_model(
    model: SlideModel,
    host: HostParameters,
    config: PreTrainedConfig,
    run: Path,
    step: int,
    *,
    dtype: torch.dtype | None,
    tokenizer_dir: Path | None,
    stop: StopSignal,
    keep: Callable[[], None] | None = None,
) -> Path:
    """Write ``run/model`` from the masters of step ``step``, whose checkpoint is already saved, or, with
    ``keep`` (Note [Export only]), is written by ``keep`` when the export cannot finish.

    A first SIGINT/SIGTERM during the export (``stop``'s handlers are still installed) cancels it between
    shards, a second interrupts it at once; either way the temp directory is removed and
    :class:`RunStopped` says how to finish. A full disk or NaN weights are a :class:`UserError` that
    keeps the checkpoint and says the same. The export ends with ``model/slide-export.json``, the step it
    holds, so `slide export RUN --push-to-hub REPO` never pushes a ``model/`` older than the run."""
    from slide_hf.run_files import stamp_export

    target = run / "model"
    finish = f"write the model with `slide export {run} {target}`"
    try:
        export_model(
            model,
            host,
            config,
            target,
            dtype=dtype,
            tokenizer_dir=tokenizer_dir,
            overwrite=True,
            cancel=lambda: stop.requested is not None,
        )
        try:
            stamp_export(target, step)
        except OSError as error:
            raise UserError(write_error(target, error)) from None
        return target  # as the user named it (relative stays relative in the messages)
    except (ExportCancelled, KeyboardInterrupt) as error:
        if isinstance(error, Interrupted):  # a second signal: its own name and status (128 + its number)
            signal_name, code = error.signal_name, error.exit_code
        else:
            signal_name = stop.requested or "SIGINT"
            code = stop.exit_code if stop.requested else 130
        kept = _kept(keep, step, finish)
        raise RunStopped(f"stopped by {signal_name} during the export; {kept}", code) from None
    except UserError as error:
        raise UserError(f"{error}; {_kept(keep, step, finish)}") from None


def _kept(keep: Callable[[], None] | None, step: int, finish: str) -> str:
    """What an export that could not finish leaves: the checkpoint of ``step``, written now by ``keep``
    when the run had not written it first (Note [Export only]), and how to finish."""
    if keep is not None:
        try:
            keep()
        except UserError as error:
            return f"the checkpoint of step {step} could not be written in its place either ({error}): retrain"
    return f"the checkpoint of step {step} is kept: {finish}"


def weights_dir(run: Path, step: int) -> Path:
    """The weights-only save of step ``step`` of the run in ``run``."""
    return run / WEIGHTS_DIR / f"step-{step:08d}"


class _MasterViews(Mapping[str, dict[str, torch.Tensor]]):
    """``unit name -> fp32 views`` of the master as ``master`` (every unit in slab order, whole) holds
    it, one unit read at a time into a tensor of its own: a view handed out stays valid while the
    export reads the next unit."""

    def __init__(self, model: SlideModel, master: ArraySource) -> None:
        self._model = model
        self._master = master
        self._starts: dict[str, int] = {}
        total = 0
        for unit in model.units:
            self._starts[unit.name] = total
            total += unit.layout.numel
        if master.numel != total or master.dtype != torch.float32:
            raise ValueError(f"a master of {total} fp32 elements is needed, got {master.numel} x {master.dtype}")
        self._last: tuple[str, dict[str, torch.Tensor]] | None = None

    def __getitem__(self, name: str) -> dict[str, torch.Tensor]:
        if self._last is None or self._last[0] != name:
            self._last = None  # let the previous unit's copy go first
            unit = next(u for u in self._model.units if u.name == name)
            values = torch.empty(unit.layout.numel, dtype=torch.float32)
            self._master.read_into(self._starts[name], values)
            self._last = (name, unit.layout.views(values))
        return self._last[1]

    def __iter__(self) -> Iterator[str]:
        return (unit.name for unit in self._model.units)

    def __len__(self) -> int:
        return len(self._model.units)


class _StreamedMaster:
    """What the export reads of a ``HostParameters`` (``unit_views``), over a master read from where the
    engine keeps it, so a weights-only save gathers no whole fp32 copy of the model on the host."""

    def __init__(self, model: SlideModel, master: ArraySource) -> None:
        self.model = model
        self._views = _MasterViews(model, master)

    def unit_views(self) -> Mapping[str, dict[str, torch.Tensor]]:
        return self._views


def streamed_master(model: SlideModel, master: ArraySource) -> HostParameters:
    """What the export reads (``unit_views()`` alone) over ``master``, the run's fp32 master in slab order
    as the engine keeps it (``Engine.checkpoint_arrays()["master"]`` of a world of one), one unit at a time."""
    return cast("HostParameters", _StreamedMaster(model, master))


def export_weights(
    model: SlideModel,
    master: ArraySource,
    config: PreTrainedConfig,
    run: Path,
    step: int,
    *,
    dtype: torch.dtype | None,
    tokenizer_dir: Path | None,
) -> Path:
    """Write the weights-only save of step ``step`` (``run/weights/step-NNNNNNNN``, replaced if a resumed
    line reaches that step again) from ``master``, the run's fp32 master in slab order
    (``Engine.checkpoint_arrays()["master"]`` of a world of one). Atomic like every export; a full disk
    is one :class:`UserError` line that says the run's checkpoints are kept."""
    target = weights_dir(run, step)
    host = streamed_master(model, master)
    try:
        return export_model(model, host, config, target, dtype=dtype, tokenizer_dir=tokenizer_dir, overwrite=True)
    except UserError as error:
        raise UserError(f"{error} (the weights-only save of step {step}); the run's checkpoints are kept") from None


def set_aside_weights(run: Path, step: int, aside: Path) -> None:
    """Move the weights-only saves of ``run`` newer than ``step`` into ``aside/weights``: a resume from
    an older checkpoint abandons them with the checkpoints of their line (slide_hf/run_dir.py's
    ``roll_back`` made ``aside``)."""
    later = [p for p in sorted((run / WEIGHTS_DIR).glob("step-*")) if p.is_dir() and p.name > f"step-{step:08d}"]
    if not later:
        return
    try:
        (aside / WEIGHTS_DIR).mkdir(exist_ok=True)
        for saved in later:
            os.rename(saved, aside / WEIGHTS_DIR / saved.name)
    except OSError as error:
        raise UserError(f"cannot set aside the weights-only saves after step {step}: {error.strerror}") from None
