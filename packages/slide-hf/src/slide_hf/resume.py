"""Which checkpoint a run resumes from, and whether its saved run state can be trusted.

``slide_core.checkpoint.read_state`` verifies ``state.json`` itself (checksum, format, the engine's
fields). What the training loop adds to it -- the model name, the data position, the RNG state, the
engine's schedule counters -- is checked here, before any array is streamed into the engine, so a bad
value is one line naming its field instead of an ``IndexError`` in the data loader or a resume that
silently continues somewhere else. When the checkpoint is corrupt, the message names the newest intact
one of the same run and how to use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slide_core.checkpoint import CheckpointCorrupt, find_latest, newest_intact, read_state
from slide_hf.errors import UserError

__all__ = ["ResumePoint", "checkpoint_to_resume", "corrupt_message", "resume_point"]


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: its step, data position, RNG state and engine schedule state."""

    checkpoint: Path
    step: int
    epoch: int
    index: int
    rng: torch.Tensor
    engine: dict[str, int | bool]


def _resume_hint(path: Path) -> str:
    return f"resume from it with --resume {path}"


def corrupt_message(error: CheckpointCorrupt, use: Callable[[Path], str] = _resume_hint) -> str:
    """``error``'s line, plus the newest intact checkpoint older than the corrupt one and what to do with
    it (``use(path)``, by default the ``--resume`` flag), or that there is none."""
    if error.checkpoint is None:
        return str(error)
    intact = newest_intact(error.checkpoint)
    if intact is None:
        return f"{error}; no older intact checkpoint of this run exists"
    return f"{error}; the newest intact one is {intact}: {use(intact)}"


def checkpoint_to_resume(path: Path) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint at ``path`` (a run directory or a checkpoint) and its verified state, or a
    :class:`UserError` naming what is wrong (with the newest intact checkpoint when it is corrupt)."""
    try:
        found = find_latest(path)
        return found, read_state(found)
    except CheckpointCorrupt as error:
        raise UserError(corrupt_message(error)) from None


def resume_point(checkpoint: Path, state: Mapping[str, Any], *, model: str, data_size: int) -> ResumePoint:
    """The validated run state of ``checkpoint`` (``state`` from :func:`checkpoint_to_resume`) for a run of
    ``model`` over ``data_size`` examples. Any missing, mistyped or out-of-range field is a
    :class:`UserError` naming it."""

    def bad(field: str, detail: str) -> UserError:
        message = f"checkpoint {checkpoint} is corrupt (state.json field extra.{field} {detail})"
        return UserError(corrupt_message(CheckpointCorrupt(message, checkpoint)))

    extra = state["extra"]
    saved_model = extra.get("model")
    if not isinstance(saved_model, str):
        raise bad("model", f"must be the model name, got {saved_model!r}")
    if saved_model != model:
        raise UserError(f"checkpoint {checkpoint} is of model {saved_model!r}, not {model!r}")
    data = extra.get("data")
    if not isinstance(data, dict):
        raise bad("data", f"must be an object with epoch and index, got {data!r}")
    epoch, index = data.get("epoch"), data.get("index")
    if not _is_int(epoch):
        raise bad("data.epoch", f"must be an integer >= 0, got {epoch!r}")
    if not _is_int(index):
        raise bad("data.index", f"must be an integer >= 0, got {index!r}")
    if index > data_size:
        raise bad("data.index", f"is {index}, beyond the {data_size} examples of this run's data")
    rng = extra.get("rng")
    size = torch.get_rng_state().numel()
    if not isinstance(rng, list) or len(rng) != size or not all(_is_int(b) and b < 256 for b in rng):
        raise bad("rng", f"must list the {size} bytes of torch's RNG state")
    engine = extra.get("engine", {})
    if not isinstance(engine, dict):
        raise bad("engine", f"must be an object, got {engine!r}")
    for key, value in engine.items():
        valid = isinstance(value, bool) if key == "defer_clipped_updates" else _is_int(value)
        if not valid:
            raise bad(f"engine.{key}", f"has the wrong type or sign: {value!r}")
    return ResumePoint(
        checkpoint, state["step"], epoch, index, torch.tensor(rng, dtype=torch.uint8), {"step": state["step"], **engine}
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
