"""The options a run was started with, read back from its newest checkpoint for ``slide train --resume DIR``.

Every checkpoint carries the run's resolved options (``extra.config`` of its ``state.json``), so a resumed
run needs no flag repeated: :func:`slide_hf.options.resume_config` merges what the user passes now.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slide_hf.errors import UserError
from slide_hf.resume import checkpoint_to_resume

__all__ = ["saved_options"]


def saved_options(path: Path) -> tuple[dict[str, Any], str]:
    """``(options, checkpoint path)`` of the newest checkpoint at ``path`` (a run directory or a checkpoint)."""
    checkpoint, state = checkpoint_to_resume(path)  # verified state.json, or one line naming an intact checkpoint
    options = state["extra"].get("config")
    if not isinstance(options, dict):
        raise UserError(f"checkpoint {checkpoint} is corrupt: state.json has no run options (extra.config)")
    return options, str(checkpoint)
