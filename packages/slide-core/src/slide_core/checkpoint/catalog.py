"""The checkpoints of a run: which exist, which is newest, which is the newest intact one (which of them
stay is :mod:`.retention`'s)."""

from __future__ import annotations

from pathlib import Path

from .errors import CheckpointCorrupt
from .manifest import STATE_FILE

__all__ = ["CHECKPOINT_PREFIX", "find_latest", "list_checkpoints", "newest_intact"]

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
