"""The checkpoints of a run: which exist, which is newest, which is the newest intact one, and pruning."""

from __future__ import annotations

import shutil
from collections.abc import Collection
from pathlib import Path

from .errors import CheckpointCorrupt
from .manifest import STATE_FILE

__all__ = ["CHECKPOINT_PREFIX", "find_latest", "list_checkpoints", "newest_intact", "prune_checkpoints"]

CHECKPOINT_PREFIX = "step-"


def list_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints directly under ``root``, oldest first. Staging directories and folders of
    any other name (such as the ``abandoned-*`` lines a rollback sets aside) are ignored."""
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and (p / STATE_FILE).exists()
    ]
    return sorted(found, key=lambda p: p.name)


def find_latest(path: Path) -> Path:
    """``path`` itself if it is a checkpoint; else the newest checkpoint of an output directory."""
    if (path / STATE_FILE).exists():
        return path
    for root in (path / "checkpoints", path):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise CheckpointCorrupt(f"no checkpoint found in {path} (looked for {path}/checkpoints/step-*/state.json)")


def newest_intact(corrupt: Path) -> Path | None:
    """The newest checkpoint older than ``corrupt`` in the same folder that passes
    :func:`~.reader.verify_checkpoint` (every file read and checked), or ``None``. Meant for the message
    that follows a corrupt checkpoint, so it is as slow as reading those checkpoints once."""
    from .reader import verify_checkpoint

    older = [p for p in list_checkpoints(corrupt.parent) if p.name < corrupt.name]
    for candidate in reversed(older):
        try:
            verify_checkpoint(candidate)
        except CheckpointCorrupt:
            continue
        return candidate
    return None


def prune_checkpoints(root: Path, keep: int, *, protect: Collection[Path] = ()) -> None:
    """Delete all but the newest ``keep`` checkpoints, and leftovers of interrupted saves. Checkpoints in
    ``protect`` (the best one by evaluation loss) stay and do not count against ``keep``."""
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    kept = {Path(p).resolve() for p in protect}
    candidates = [p for p in list_checkpoints(root) if p.resolve() not in kept]
    for old in candidates[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
