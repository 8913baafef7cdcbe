"""What a checkpoint save or load raises: one line that names the file at fault."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CheckpointCorrupt", "CheckpointWriteError"]


class CheckpointCorrupt(ValueError):
    """A checkpoint is incomplete, truncated or fails its checksums; the message names the file.

    ``checkpoint`` is the checkpoint directory at fault (``None`` when none was found at all, or when the
    checkpoint is intact but of another model): what a run falls back from."""

    def __init__(self, message: str, checkpoint: Path | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class CheckpointWriteError(OSError):
    """A save failed (full disk, file too large, no permission); the previous checkpoint is untouched."""
