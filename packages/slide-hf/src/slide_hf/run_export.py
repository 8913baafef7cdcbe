"""A run's model export, as `slide train` ends and as `slide export` redoes it from a checkpoint.

The export is the last step of a run and the one most exposed to a full disk (it writes the whole model
at once) or to a SIGTERM from a scheduler. `slide train` therefore writes its final checkpoint first;
the export then either publishes a complete model directory or fails with one line that says the
checkpoint is kept and gives the command that finishes the job (``slide export RUN RUN/model``), and
leaves no temporary directory behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from slide_hf.errors import RunStopped, UserError
from slide_hf.export import ExportCancelled, NonFiniteWeights, export_hf

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from slide_core.host_params import HostParameters
    from slide_core.unit import SlideModel

__all__ = ["StopSignal", "export_model", "export_run_model", "write_error"]


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
) -> Path:
    """Write ``run/model`` from the masters of step ``step``, whose checkpoint is already saved.

    A first SIGINT/SIGTERM during the export (``stop``'s handlers are still installed) cancels it between
    shards, a second interrupts it at once; either way the temp directory is removed and
    :class:`RunStopped` says how to finish. A full disk or NaN weights are a :class:`UserError` that
    keeps the checkpoint and says the same."""
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
        return target  # as the user named it (relative stays relative in the messages)
    except (ExportCancelled, KeyboardInterrupt):
        signal_name = stop.requested or "SIGINT"
        code = stop.exit_code if stop.requested else 130
        raise RunStopped(
            f"stopped by {signal_name} during the export; the checkpoint of step {step} is kept: {finish}", code
        ) from None
    except UserError as error:
        raise UserError(f"{error}; the checkpoint of step {step} is kept: {finish}") from None
