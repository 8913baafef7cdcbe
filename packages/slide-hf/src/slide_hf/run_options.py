"""The options a run was started with, read back from its newest checkpoint for ``slide train --resume DIR``.

Every checkpoint carries the run's resolved options (``extra.config`` of its ``state.json``), so a resumed
run needs no flag repeated: :func:`slide_hf.options.resume_config` merges what the user passes now.

A data-parallel checkpoint may be resumed by another number of processes (each reads its shards out of
the old ranks', slide_core/checkpoint/reader.py). What a resumed run keeps is then the global batch,
``--batch-size`` x processes: the saved per-process ``--batch-size`` is rescaled to this run's processes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from slide_hf.errors import UserError
from slide_hf.resume import checkpoint_to_resume
from slide_hf.spelling import option

__all__ = ["init_model_options", "saved_options"]


def saved_options(path: Path) -> tuple[dict[str, Any], str]:
    """``(options, checkpoint path)`` of the newest checkpoint at ``path`` (a run directory or a checkpoint)."""
    checkpoint, state = checkpoint_to_resume(path)  # verified state.json, or one line naming an intact checkpoint
    options = state["extra"].get("config")
    if not isinstance(options, dict):
        raise UserError(f"checkpoint {checkpoint} is corrupt: state.json has no run options (extra.config)")
    saved_ranks = state["world_size"]  # how many processes wrote it, whatever its format
    ranks = _env_world_size()
    batch_size = options.get("batch_size")
    if saved_ranks != ranks and isinstance(batch_size, int) and isinstance(saved_ranks, int) and saved_ranks > 0:
        rows = batch_size * saved_ranks
        if rows % ranks:
            raise UserError(
                f"checkpoint {checkpoint} stepped on {rows} rows ({option('batch_size', batch_size)} x {saved_ranks} "
                f"process(es)), which {ranks} processes cannot share evenly; resume it with a number of "
                f"processes that divides {rows}"
            )
        options = {**options, "batch_size": rows // ranks}
    return options, str(checkpoint)


def _env_world_size() -> int:
    """This run's number of processes, as torchrun tells it (1 without torchrun or with a bad value, which
    the process group then names)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE") or 1))
    except ValueError:
        return 1


def init_model_options(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` (the options the user gave) with ``--init-from RUN``'s model: a new run from a run's weights
    is a run of that run's model, so without ``--model`` it takes the saved ``model`` and ``tokenizer``
    options of the checkpoint it starts from (``--model`` given is compared with it, shape by shape, when
    the run starts: slide_hf/init_from.py). Without ``--init-from``, or with ``--model``, ``given`` as it is."""
    source = given.get("init_from")
    if source is None or "model" in given or not Path(source).expanduser().is_dir():
        return given  # a path that is not there is refused, naming the option, when the run starts
    try:
        _, state = checkpoint_to_resume(
            Path(source).expanduser(), lambda intact: f"start from it with {option('init_from', intact)}"
        )
    except UserError as error:
        raise UserError(f"{option('init_from', source)}: {error}") from None
    saved = state["extra"].get("config")
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), str):
        return given
    taken = {key: saved[key] for key in ("model", "tokenizer") if isinstance(saved.get(key), str)}
    return {**taken, **given}
