"""Which checkpoint a run resumes from, and whether its saved run state can be trusted.

``slide_core.checkpoint.read_state`` verifies ``state.json`` itself (checksum, format, the engine's
fields). What the training loop adds to it -- the model name, the data position, the RNG state, the
engine's schedule counters -- is checked here, before any array is streamed into the engine, so a bad
value is one line naming its field instead of an ``IndexError`` in the data loader or a resume that
silently continues somewhere else. When the checkpoint is corrupt, the message names the newest intact
one of the same run and how to use it. A step folder newer than every complete checkpoint but without its
``state.json`` is damage too (a save publishes its folder whole, with the state inside): resuming the
older one silently would let the new line's save replace it, so it is refused the same way
(:func:`damaged_newest`).

Two more things a resume must not change silently: the data (:func:`check_same_data` compares a SHA-256
of the prepared rows with the checkpoint's) and the lr curve (:func:`resumed_schedule` continues the
saved one when the run's length changes, instead of replanning it from the top).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import torch

from slide_core.checkpoint import CheckpointCorrupt, find_latest, newest_intact, read_state
from slide_core.checkpoint.catalog import CHECKPOINT_PREFIX
from slide_core.checkpoint.manifest import STATE_FILE
from slide_core.schedule import LRSchedule
from slide_hf.errors import UserError
from slide_hf.spelling import option, train_call

__all__ = [
    "ResumePoint",
    "check_same_data",
    "checkpoint_to_resume",
    "corrupt_message",
    "damaged_newest",
    "resume_point",
    "resumed_schedule",
    "run_data_digests",
]

log = logging.getLogger("slide.train")


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
    return f"resume from it with {option('resume', path)}"


def corrupt_message(error: CheckpointCorrupt, use: Callable[[Path], str] = _resume_hint) -> str:
    """``error``'s line, plus the newest intact checkpoint older than the corrupt one and what to do with
    it (``use(path)``, by default the ``--resume`` flag), or that there is none."""
    if error.checkpoint is None:
        return str(error)
    intact = newest_intact(error.checkpoint)
    if intact is None:
        return f"{error}; no older intact checkpoint of this run exists"
    return f"{error}; the newest intact one is {intact}: {use(intact)}"


def damaged_newest(path: Path) -> CheckpointCorrupt | None:
    """The error for run directory ``path`` (or its ``checkpoints/``) when its newest step folder lacks
    its ``state.json`` -- a complete checkpoint always has one, so that folder is damaged; ``None`` when
    the newest step folder is a checkpoint or there is none."""
    for root in (path / "checkpoints", path):
        if not root.is_dir():
            continue
        steps = sorted(p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())
        if steps:
            newest = steps[-1]
            if (newest / STATE_FILE).exists():
                return None
            return CheckpointCorrupt(f"checkpoint {newest} is corrupt ({STATE_FILE} is missing)", newest)
    return None


def checkpoint_to_resume(path: Path, use: Callable[[Path], str] = _resume_hint) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint at ``path`` (a run directory or a checkpoint) and its verified state, or a
    :class:`UserError` naming what is wrong (with the newest intact checkpoint when it is corrupt, and
    ``use(path)``: what to do with it)."""
    try:
        if not (path / STATE_FILE).exists():
            damaged = damaged_newest(path)
            if damaged is not None:
                raise damaged
        found = find_latest(path)
        return found, read_state(found)
    except CheckpointCorrupt as error:
        raise UserError(corrupt_message(error, use)) from None


def resume_point(
    checkpoint: Path, state: Mapping[str, Any], *, model: str, data_size: int, allow_data_change: bool = False
) -> ResumePoint:
    """The validated run state of ``checkpoint`` (``state`` from :func:`checkpoint_to_resume`) for a run of
    ``model`` over ``data_size`` rows. Any missing, mistyped or out-of-range field is a :class:`UserError`
    naming it.

    A saved position past the end of the data is where a run resumed onto shorter data lands (the position
    counts rows of the data it trained on). With ``allow_data_change`` the run goes on at the start of the
    next epoch of the new data, as an epoch that runs out does, and says so in one line; without it, a
    checkpoint that recorded its data's digest (so the data is the same, :func:`check_same_data`) is
    inconsistent, and one that did not is refused with what the two sizes are and the option that allows it."""

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
        if allow_data_change:
            log.warning(
                "%s: the data now has %d rows and %s stopped at row %d of epoch %d; training continues at the "
                "start of epoch %d",
                option("allow_data_change"),
                data_size,
                checkpoint,
                index,
                epoch,
                epoch + 1,
            )
            epoch, index = epoch + 1, 0
        elif isinstance(extra.get("data_digest"), dict):
            raise bad("data.index", f"is {index}, beyond the {data_size} examples of this run's data")
        else:
            raise UserError(
                f"checkpoint {checkpoint} stopped at row {index} of epoch {epoch}, but the data now has {data_size} "
                f"rows: if it changed since, resume with {option('allow_data_change')} to start its next epoch"
            )
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


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def run_data_digests(cfg: Any, dataset: Any, eval_set: Any) -> dict[str, dict[str, Any]]:
    """What a checkpoint records of the data it trained on, per split: the prepared rows' SHA-256
    (``Dataset.digest``), their count, and the option that named them (for the message)."""
    digests = {"train": {"sha256": dataset.digest, "rows": len(dataset), "option": "data"}}
    if eval_set is not None:
        name = "eval_data" if cfg.eval_data is not None else "data"
        digests["eval"] = {"sha256": eval_set.digest, "rows": len(eval_set), "option": name}
    return digests


def check_same_data(
    checkpoint: Path, state: Mapping[str, Any], now: Mapping[str, Mapping[str, Any]], *, allow: bool
) -> None:
    """Refuse in one line a resume whose prepared rows differ from those ``checkpoint`` trained on (an
    edited, replaced or re-tokenized data file): its saved position counts rows of the old data, so the
    run would silently go on somewhere else in the new. ``allow`` (``--allow-data-change``) turns that
    into a warning. A checkpoint that predates the record is not checked."""
    saved = state["extra"].get("data_digest")
    if not isinstance(saved, dict):
        log.debug("checkpoint %s records no data digest; the data is not compared", checkpoint)
        return
    for split, current in now.items():
        before = saved.get(split)
        if not isinstance(before, dict) or before.get("sha256") in (None, "", current["sha256"]):
            continue
        config = state["extra"].get("config", {})
        value = config.get(current["option"]) if isinstance(config, dict) else None
        what = option(current["option"], value) if value is not None else "the bundled text"
        what = f"the evaluation rows of {what}" if split == "eval" else what
        change = (
            f"prepared rows sha256 {str(before['sha256'])[:12]} -> {current['sha256'][:12]}, "
            f"{before.get('rows')} -> {current['rows']} rows"
        )
        if allow:
            log.warning("%s changed since %s (%s); training on it from the saved position", what, checkpoint, change)
            continue
        raise UserError(
            f"{what} changed since {checkpoint} was saved ({change}); its saved position counts the old rows: "
            f"resume with {option('allow_data_change')} to train on the new data from there, or start a new run"
        )


def resumed_schedule(checkpoint: Path, state: Mapping[str, Any], planned: LRSchedule, *, length: str) -> LRSchedule:
    """The lr schedule a run resumed from ``checkpoint`` follows, given the one its options ``planned``.

    The same length: the checkpoint's own schedule, so the resume is bit-identical. Another length
    (``--steps``, ``--epochs``): the saved curve continued from the resumed step to the new end
    (``LRSchedule.extend``: the same shape, from the lr it had there down to the floor), logged in one
    line. Replanning the whole curve for the new length instead would send the lr back up it (35x at
    once for a finished 20-step cosine run resumed to 30). A finished run's lr had reached its floor, so
    its new steps train at the floor, which a warning says, naming the ``--init-from`` run that trains
    on with a new schedule instead (slide_hf/init_from.py). ``length`` names the option that set the
    length (``steps`` or ``epochs``)."""
    extra = state["extra"]
    step = state["step"]
    if isinstance(extra.get("schedule"), dict):
        try:
            saved = LRSchedule.from_dict(extra["schedule"])
        except (KeyError, TypeError, ValueError) as error:
            detail = f"state.json field extra.schedule is not an lr schedule: {error}"
            raise UserError(
                corrupt_message(CheckpointCorrupt(f"checkpoint {checkpoint} is corrupt ({detail})"))
            ) from None
    else:  # written before checkpoints kept the schedule: the saved options and length rebuild it
        saved = dataclasses.replace(planned, total_steps=int(extra.get("total_steps", planned.total_steps)))
    total = planned.total_steps
    if total == saved.final_steps or step >= total:
        return saved
    extended = saved.extend(step, total)
    if saved.kind in ("constant", "inverse_sqrt"):
        return extended  # a constant or inverse-sqrt lr does not depend on the length
    start, floor = saved.lr_at(step), saved.floor_lr
    log.info(
        "%s: the run now ends at step %d instead of %d; its %s lr continues from %.3g at step %d down to %.3g at "
        "the new end (docs/checkpoints.md)",
        option(length),
        total,
        saved.final_steps,
        saved.kind,
        start,
        step,
        floor,
    )
    if start <= floor and total > saved.final_steps and step >= saved.final_steps:
        log.warning(
            "the %s lr of %s had decayed to its floor %.3g by step %d: the %d new steps train at that lr; to train "
            "further with a new lr schedule, start a new run from its weights and AdamW state: %s",
            saved.kind,
            checkpoint,
            floor,
            step,
            total - step,
            train_call(init_from=checkpoint, steps=total - step, lr="LR", output="NEW_RUN"),
        )
    return extended
