"""The options a run was started with, read back from its newest checkpoint for ``slide train --resume DIR``.

Every checkpoint carries the run's resolved options (``extra.config`` of its ``state.json``), so a resumed
run needs no flag repeated: :func:`slide_hf.options.resume_config` merges what the user passes now.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slide_core.checkpoint import CheckpointCorrupt, find_latest
from slide_hf.errors import UserError

__all__ = ["saved_options"]


def saved_options(path: Path) -> tuple[dict[str, Any], str]:
    """``(options, checkpoint path)`` of the newest checkpoint at ``path`` (a run directory or a checkpoint)."""
    try:
        checkpoint = find_latest(path)
    except CheckpointCorrupt as error:
        raise UserError(str(error)) from None
    state_file = checkpoint / "state.json"
    try:
        state = json.loads(state_file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"checkpoint {checkpoint} is corrupt: cannot read state.json ({error})") from None
    options = state.get("extra", {}).get("config") if isinstance(state, dict) else None
    if not isinstance(options, dict):
        raise UserError(f"checkpoint {checkpoint} is corrupt: state.json has no run options (extra.config)")
    return options, str(checkpoint)
