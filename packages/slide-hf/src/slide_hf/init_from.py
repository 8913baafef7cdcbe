"""``--init-from``: a new run that starts from another run's weights and AdamW state.

A finished run resumed with more steps continues its own lr curve, which has decayed to its floor by then
(slide_hf/resume.py). To train on at another lr, with another schedule, length or data, a new run (its own
output directory and options, from step 1) takes a checkpoint's fp32 master and, unless
``--init-weights-only``, its AdamW moments and Adam step count. Its updates are then AdamW continued under
a new lr schedule: the moments go on from where they were, and the bias correction counts on from the
step the checkpoint reached (torch's per-parameter ``step``; every parameter here has stepped as often).
``--init-weights-only`` takes the master alone: AdamW starts from zero moments and step 0, as a fresh
fine-tune of those weights.

The weights and state come back through what a resume uses: the master is read into the host master before
the engine starts (as a model's HF weights would be), and the AdamW state is streamed into the running
engine by ``Engine.restore_checkpoint`` (slide_core/engine/checkpointing.py) with its step count; neither the
checkpoint's data position, RNG state nor lr schedule is taken.

Refused in one line each, before any weight is read: a path that is no run directory or checkpoint; a
checkpoint of a model whose units or parameter shapes differ from this run's (compared against the run's
``config/``); and, taking the AdamW state, a checkpoint whose state is in another ``--optimizer-state`` than
this run keeps (bf16 and int8 moments are rounded, so no conversion carries them both ways exactly: the
formats must match, or ``--init-weights-only`` leaves the state behind). ``--master`` may differ: a
checkpoint holds the fp32 master whatever the run stored it as, and either format holds those values exactly.
``--resume`` with ``--init-from`` is refused by the options' rules (slide_hf/options/validate.py).

A run started so records where it came from in its checkpoints (``extra.init_from``: the checkpoint, the
Adam steps before this run's own, whether it took the weights alone). The engine counts Adam steps; the
run's own step is that count less the steps before it, which a resume of the run reads back from there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slide_core.checkpoint import CheckpointCorrupt
from slide_core.optim.state_formats import StateFormatMismatch, checkpoint_state_format
from slide_hf.errors import UserError
from slide_hf.model_checkpoint import load_master
from slide_hf.resume import checkpoint_to_resume, corrupt_message
from slide_hf.spelling import option

if TYPE_CHECKING:
    from slide_core.engine import Engine
    from slide_core.host_params import HostParameters
    from slide_core.unit import SlideModel, Unit

__all__ = ["InitPoint", "init_point", "init_record", "load_initial_master", "restore_adam_state"]

log = logging.getLogger("slide.train")


@dataclass(frozen=True)
class InitPoint:
    """The checkpoint a new run starts from, and what it takes of it."""

    checkpoint: Path
    adam_step: int
    """The Adam steps the checkpoint's moments have seen: where this run's bias correction counts on from
    (0 with ``weights_only``)."""
    weights_only: bool

    def record(self) -> dict[str, Any]:
        """What the run's checkpoints keep of it (``extra.init_from``)."""
        return {
            "checkpoint": str(self.checkpoint.resolve()),
            "adam_step": self.adam_step,
            "weights_only": self.weights_only,
        }


def _use(intact: Path) -> str:
    return f"start from it with {option('init_from', intact)}"


def init_point(path: Path, model: SlideModel, *, weights_only: bool, state_format: str) -> InitPoint:
    """Where ``--init-from path`` starts this run of ``model``: the newest complete checkpoint of a run
    directory, or the checkpoint named; refused in one line when it cannot (the module docstring)."""
    flag = option("init_from", path)
    if not path.is_dir():
        raise UserError(f"{flag}: no such directory (give a slide train run directory or one of its checkpoints)")
    try:
        checkpoint, state = checkpoint_to_resume(path, _use)
    except UserError as error:
        raise UserError(f"{flag}: {error}") from None
    _check_shapes(checkpoint, state, model, flag)
    if weights_only:
        return InitPoint(checkpoint, 0, weights_only=True)
    saved = checkpoint_state_format(checkpoint)
    if saved is not None and saved != state_format:
        raise UserError(
            f"{flag}: checkpoint {checkpoint} holds its AdamW state in {saved} and this run keeps "
            f"{option('optimizer_state', state_format)}; give {option('optimizer_state', saved)} to carry it "
            f"exactly, or {option('init_weights_only')} to start AdamW afresh"
        )
    return InitPoint(checkpoint, _adam_step(checkpoint, state), weights_only=False)


def _adam_step(checkpoint: Path, state: Mapping[str, Any]) -> int:
    """The Adam step count the checkpoint's engine had reached (``extra.engine.step``; a checkpoint from
    before the engine recorded it stepped once per run step)."""
    engine = state["extra"].get("engine", {})
    step = engine.get("step", state["step"]) if isinstance(engine, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        detail = f"state.json field extra.engine.step must be the Adam step count, got {step!r}"
        raise UserError(
            corrupt_message(CheckpointCorrupt(f"checkpoint {checkpoint} is corrupt ({detail})", checkpoint))
        )
    return step


def _check_shapes(checkpoint: Path, state: Mapping[str, Any], model: SlideModel, flag: str) -> None:
    """Refuse a checkpoint whose model's units or parameter shapes differ from ``model``'s, compared with the
    model its run's ``config/`` builds (as `slide export` reads it), naming the first difference."""
    from slide_hf import build_model, load_config
    from slide_hf.run_dir import run_of

    run = run_of(checkpoint)
    if not (run / "config" / "config.json").is_file():
        raise UserError(f"{flag}: {run} has no config/config.json beside its checkpoints (not a slide train run?)")
    try:
        theirs = build_model(load_config(run / "config"))
    except ValueError as error:  # a damaged config.json, a model type this version cannot build
        raise UserError(f"{flag}: {run}: {str(error).strip().splitlines()[0]}") from None
    difference = _first_difference(theirs.units, model.units)
    if difference is not None:
        trained = state["extra"].get("model")
        of = f" (it trained {option('model', trained)})" if isinstance(trained, str) else ""
        raise UserError(f"{flag}: the checkpoint's model differs from this run's{of}: {difference}")


def _first_difference(theirs: Sequence[Unit], ours: Sequence[Unit]) -> str | None:
    """The first unit or parameter whose name or shape differs, as the message says it; ``None`` if none."""
    if len(theirs) != len(ours):
        return f"it has {len(theirs)} units (embedding, blocks, head) and this model {len(ours)}"
    for their_unit, our_unit in zip(theirs, ours, strict=True):
        if their_unit.name != our_unit.name:
            return f"its unit {their_unit.name!r} is {our_unit.name!r} here"
        their_shapes = {spec.name: spec.shape for spec in their_unit.layout}
        our_shapes = {spec.name: spec.shape for spec in our_unit.layout}
        for name in sorted(their_shapes.keys() | our_shapes.keys()):
            there, here = their_shapes.get(name), our_shapes.get(name)
            if there != here:
                shown = [f"{list(shape)}" if shape is not None else "absent" for shape in (there, here)]
                return f"{our_unit.name}.{name} is {shown[0]} there and {shown[1]} here"
    return None


def load_initial_master(point: InitPoint, host: HostParameters) -> None:
    """The run's initial weights: the checkpoint's fp32 master, into ``host`` (either ``--master`` format;
    with data parallel, this rank's shards of it)."""
    try:
        load_master(point.checkpoint, host)
    except CheckpointCorrupt as error:
        raise UserError(f"{option('init_from')}: {corrupt_message(error, _use)}") from None


def restore_adam_state(point: InitPoint, engine: Engine) -> None:
    """Into the running engine, before its first step: the checkpoint's AdamW moments (its master again,
    the same values) and its Adam step count, as a resume restores them; or nothing with
    ``--init-weights-only``. Logs what the run took."""
    if point.weights_only:
        log.info(
            "started from the weights of %s; AdamW starts afresh (%s)", point.checkpoint, option("init_weights_only")
        )
        return
    try:
        engine.restore_checkpoint(point.checkpoint)
    except CheckpointCorrupt as error:
        raise UserError(f"{option('init_from')}: {corrupt_message(error, _use)}") from None
    except StateFormatMismatch as error:
        raise UserError(f"{option('init_from')}: {error}") from None
    engine.restore_schedule_state({"step": point.adam_step, "steps_before": point.adam_step})
    log.info(
        "started from the weights and AdamW state of %s (its moments after %d Adam steps); this run's own lr "
        "schedule starts at its step 1",
        point.checkpoint,
        point.adam_step,
    )


def init_record(checkpoint: Path, state: Mapping[str, Any]) -> dict[str, Any] | None:
    """What ``checkpoint`` of a run started with ``--init-from`` recorded of it (``extra.init_from``, its
    verified ``state``), for the run's resume; ``None`` for a run that was not. A record that is not one is
    refused as damage."""
    record = state["extra"].get("init_from")
    if record is None:
        return None
    step = record.get("adam_step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        detail = f"state.json field extra.init_from must give the Adam steps before the run, got {record!r}"
        raise UserError(
            corrupt_message(CheckpointCorrupt(f"checkpoint {checkpoint} is corrupt ({detail})", checkpoint))
        )
    return dict(record)
