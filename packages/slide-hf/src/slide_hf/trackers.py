"""Experiment trackers behind ``--report-to``: TensorBoard, Weights & Biases and MLflow.

Each tracker is an optional package, imported only when a run asks for it, so a missing one is one line
before the run reads its data (:func:`check_trackers`), never a traceback after an hour of training.
``--report-to none`` (the default) starts none. W&B and MLflow name the run ``--run-name`` (the output
directory's name by default); W&B files its run under ``--wandb-project`` (else ``$WANDB_PROJECT``, else
``slideformer``) and writes its local files where ``$WANDB_DIR`` says, else into the run directory. They all take the same
per-step records as ``metrics.jsonl`` and log the numeric fields against the optimizer step.

A tracker is a side channel: if it fails while training (a full disk under ``tensorboard/``, a tracking
server that went away), the run warns once and goes on without it. The metrics file and the checkpoints
are what a run must not lose; a dashboard is not.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from slide_hf.errors import UserError

__all__ = ["Tracker", "check_trackers", "open_trackers"]

log = logging.getLogger("slide.train")

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class Tracker(Protocol):
    name: str

    def log(self, record: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def _numeric(record: Mapping[str, Any]) -> dict[str, float]:
    """The fields a tracker can plot: finite numbers, booleans excluded."""
    return {
        key: float(value)
        for key, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "step" and math.isfinite(value)
    }


def _require(name: str) -> Any:
    try:
        return importlib.import_module(_PACKAGES[name])
    except ImportError:
        raise UserError(
            f"--report-to {name} needs the {_PACKAGES[name]} package: pip install {_PACKAGES[name]} "
            f"(or pip install 'slide-hf[{name}]')"
        ) from None


def check_trackers(names: tuple[str, ...]) -> None:
    """Import every tracker package ``names`` needs, refusing the first missing one in one line: called
    before the run tokenizes its data or loads a weight, so the refusal costs nothing."""
    for name in names:
        _require(name)


def _run_name(output: Path, options: Mapping[str, Any]) -> str:
    """``--run-name``, else the output directory's name."""
    return str(options.get("run_name") or output.name)


class TensorBoardTracker:
    """Event files under ``<output>/tensorboard``, one scalar series per metric."""

    name = "tensorboard"

    def __init__(self, output: Path, options: Mapping[str, Any]) -> None:
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(output / "tensorboard"))
        self._writer.add_text("options", "\n".join(f"    {k} = {v!r}" for k, v in options.items()), 0)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        for key, value in _numeric(record).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """One W&B run per training run. ``WANDB_MODE=offline`` keeps it local. ``WANDB_DIR``, where the user
    set it, is where W&B writes its files (W&B reads it when ``dir`` is not given); otherwise they go into
    the run directory, beside the run's other outputs, rather than into the working directory."""

    name = "wandb"

    def __init__(self, output: Path, options: Mapping[str, Any]) -> None:
        wandb = _require("wandb")
        project = options.get("wandb_project") or os.environ.get("WANDB_PROJECT") or "slideformer"
        where = {} if os.environ.get("WANDB_DIR") else {"dir": str(output)}
        self._run = wandb.init(project=project, name=_run_name(output, options), config=dict(options), **where)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        self._run.log(_numeric(record), step=step)

    def close(self) -> None:
        self._run.finish()


class MLflowTracker:
    """An MLflow run. Without ``MLFLOW_TRACKING_URI`` it stays in the run directory: an SQLite store
    (``<output>/mlflow.db``, MLflow's recommended local backend) when SQLAlchemy is installed (full
    ``mlflow``), else the file store ``<output>/mlruns`` that ``mlflow-skinny`` can write, which MLflow 3
    accepts only with ``MLFLOW_ALLOW_FILE_STORE`` (set here unless the user set it)."""

    name = "mlflow"

    def __init__(self, output: Path, options: Mapping[str, Any]) -> None:
        self._mlflow = _require("mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            self._mlflow.set_tracking_uri(self.local_uri(output))
        if self._mlflow.get_tracking_uri().startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._mlflow.start_run(run_name=_run_name(output, options))
        self._mlflow.log_params({key: str(value) for key, value in options.items()})

    @staticmethod
    def local_uri(output: Path) -> str:
        if importlib.util.find_spec("sqlalchemy") is not None:
            return f"sqlite:///{(output / 'mlflow.db').resolve()}"
        return (output / "mlruns").resolve().as_uri()

    def log(self, record: Mapping[str, Any], step: int) -> None:
        self._mlflow.log_metrics(_numeric(record), step=step)

    def close(self) -> None:
        self._mlflow.end_run()


_TRACKERS: dict[str, type] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MLflowTracker}


def open_trackers(names: tuple[str, ...], output: Path, options: Mapping[str, Any]) -> list[Tracker]:
    """Start the trackers ``names`` for a run writing to ``output``; a missing package is one line."""
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(_TRACKERS[name](output, options))
    except UserError:
        for tracker in opened:
            tracker.close()
        raise
    except Exception as error:  # a tracker's own setup failure (login, server) is the user's to fix
        for tracker in opened:
            tracker.close()
        raise UserError(f"--report-to {name}: could not start ({str(error).splitlines()[0] or error!r})") from None
    return opened
