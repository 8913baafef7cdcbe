"""Which checkpoints of a run stay: the retention rule, applied to the run's line and to abandoned lines.

Note [Retention]: a run keeps the newest ``keep`` resumable checkpoints. A protected checkpoint (the best
one by evaluation loss, ``--save-best``) is never deleted: when it is among the newest ``keep``, ``keep``
stay; when it is older, it stays in addition, ``keep + 1`` (the HF Trainer's "best is never deleted",
with the count stated plainly). Checkpoints of abandoned lines (``abandoned-*``, set aside when
a run resumed from an older checkpoint) count as older than every checkpoint of the current line: they
are the first to go, so once the current line holds ``keep`` checkpoints no abandoned one is left. Only
the ``step-*`` checkpoints of an abandoned line are deleted: the folder also holds the model exported
from that line (which may hold the user's own files) and whatever else was set aside with it, so it is
removed only once it is empty, never with what it still holds. Until then its checkpoints remain a
fallback the run can still resume from.

``make_room`` (``--save-delete-first``) prunes to ``keep - 1`` before a save, so that the save being
written brings the count back to ``keep``: a disk that holds ``keep`` checkpoints but not one more can
still save. Between the deletion and the publication the run has one checkpoint fewer; with ``keep`` 1 it
has none (the best aside).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Collection
from pathlib import Path

from .catalog import list_checkpoints

__all__ = ["ABANDONED_PREFIX", "prune", "retained", "retention_candidates"]

ABANDONED_PREFIX = "abandoned-"


def retention_candidates(root: Path) -> list[Path]:
    """Every published checkpoint of the run in ``root``, oldest first in the retention's order: the
    abandoned lines' (oldest folder first, each by step), then the current line's (Note [Retention])."""
    lines = sorted(p for p in root.glob(f"{ABANDONED_PREFIX}*") if p.is_dir()) if root.is_dir() else []
    return [checkpoint for line in lines for checkpoint in list_checkpoints(line)] + list_checkpoints(root)


def retained(root: Path, keep: int, *, protect: Collection[Path] = ()) -> list[Path]:
    """The checkpoints of ``root`` that :func:`prune` with ``keep`` leaves, oldest first."""
    return _retained(retention_candidates(root), keep, protect)


def _retained(candidates: list[Path], keep: int, protect: Collection[Path]) -> list[Path]:
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    kept = {Path(p).resolve() for p in protect}
    newest = set(candidates[max(0, len(candidates) - keep) :]) if keep else set()
    return [p for p in candidates if p in newest or p.resolve() in kept]


def prune(root: Path, keep: int, *, protect: Collection[Path] = (), leftovers: bool = True) -> list[Path]:
    """Delete the checkpoints of ``root`` (and of its abandoned lines) that the retention rule does not
    keep (Note [Retention]); return them. ``leftovers``: also remove staging directories of interrupted
    saves (``.tmp-*``), which is safe only while no save of this run is being written."""
    if leftovers:
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    candidates = retention_candidates(root)
    keeping = set(_retained(candidates, keep, protect))
    removed = [p for p in candidates if p not in keeping]
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    for line in root.glob(f"{ABANDONED_PREFIX}*") if root.is_dir() else []:
        with contextlib.suppress(OSError):  # not empty (a model, the user's files) or not a folder: it stays
            line.rmdir()
    return removed
