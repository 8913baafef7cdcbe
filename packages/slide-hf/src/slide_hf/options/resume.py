"""A run's options saved with it, and the options of a run that resumes it.

Resuming (:func:`resume_config`) restores the saved options and lets the command line change only what
cannot change the math of the run: how long it goes on, how often it saves, evaluates and logs, and where
it runs. Anything else differing from the saved run is refused in one line naming both values.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from slide_hf.errors import UserError
from slide_hf.options.config import _PATH_FIELDS, TrainConfig, default_lr, train_options
from slide_hf.spelling import option

__all__ = ["MACHINE_OPTIONS", "RESUME_SAFE_OPTIONS", "config_dict", "resume_config"]


def config_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The run's options as JSON-ready values (kept in every checkpoint and in ``options.json``).

    Inputs that exist here (data files, model and tokenizer directories, a chat template file) are saved as
    absolute paths, so ``--resume`` finds them from any working directory."""
    values: dict[str, Any] = {}
    for key, value in asdict(cfg).items():
        if key == "data" and isinstance(value, tuple):
            values[key] = [_saved_input(item) for item in value]
            continue
        if key in _INPUTS and value is not None and Path(str(value)).expanduser().exists():
            value = str(Path(str(value)).expanduser().resolve())
        elif isinstance(value, Path):
            value = str(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        values[key] = value
    return values


_INPUTS = frozenset({"model", "tokenizer", "data", "eval_data", "chat_template", "nvme_dir", "init_from", "ref_model"})


def _saved_input(value: Path) -> str:
    path = value.expanduser()
    return str(path.resolve()) if path.exists() else str(value)


RESUME_SAFE_OPTIONS = frozenset(
    {
        "steps",
        "epochs",
        "save_every",
        "keep_checkpoints",
        "save_weights_every",
        "save_delete_first",
        "save_async",
        "eval_every",
        "save_best",
        "metrics",
        "report_to",
        "run_name",
        "wandb_project",
        "push_to_hub",
        "hub_private",
        "log_every",
        "resume",
        "output",
        "overwrite",
        "save_dtype",
        "allow_data_change",
        "max_record_size",
    }
)
"""Options a resumed run may change: how long it goes on and how it saves, evaluates and reports."""

MACHINE_OPTIONS = frozenset(
    {
        "device",
        "gpu_memory",
        "offload_optimizer",
        "nvme_dir",
        "nvme_fraction",
        "offload_activations",
        "block_slots",
        "master",
        "update_placement",
    }
)
"""Options that say where the run executes. A resumed run may change them (it may land on another machine);
placement moves arrays between host, GPU and disk, and ``master`` stores the same fp32 values another way
(checkpoints hold them in fp32 either way): neither changes what the arrays hold."""


_NOT_RESTORED = frozenset({"output", "overwrite", "resume", "allow_data_change", "init_from", "init_weights_only"})
"""What belongs to one invocation: where it was, and what it allowed (replacing a directory, training on
changed data), or where its weights came from (``--init-from``: a resume takes them from its own checkpoint).
A later resume asks again."""


def _saved_default_lr(model: Any) -> float:
    """The lr an older checkpoint that saved ``lr = None`` trained with (its model a preset or a directory)."""
    from slide_hf.presets import PRESETS

    name = str(model)
    return default_lr(name in PRESETS and not Path(name).expanduser().is_dir())


def resume_config(saved: Mapping[str, Any], given: Mapping[str, Any], *, source: str) -> TrainConfig:
    """The options of a resumed run: ``saved`` (a checkpoint's options) updated by ``given`` (what the user
    passed now), refusing in one line any change to an option outside :data:`RESUME_SAFE_OPTIONS` and
    :data:`MACHINE_OPTIONS`. ``source`` names the checkpoint in messages.

    Paths compare after resolving (``./tinyqwen`` is ``tinyqwen``); options the saved run did not record
    (an older checkpoint) take the new value or the default."""
    known = {f.name for f in fields(TrainConfig)}
    # Where the run was, and whether it was allowed to replace a directory, belong to that invocation: a
    # resumed run writes into the directory it resumes from (a moved or copied run stays where it is now),
    # and a saved --overwrite must never delete the checkpoints it resumes from.
    values = {key: value for key, value in saved.items() if key in known and key not in _NOT_RESTORED}
    if _inside(saved.get("metrics"), saved.get("output")):
        values.pop("metrics")  # the run's own file: it follows the run directory (the default path)
    if "lr" in values and values["lr"] is None:  # saved before the recipe recorded the lr it resolved
        values["lr"] = _saved_default_lr(values.get("model"))
    canonical = {item.name: item for item in train_options()}
    for key, value in given.items():
        if key in canonical:  # bf16 is bfloat16: an alias given now matches the canonical value saved
            value = canonical[key].normalised(value)
        if key not in known:
            raise UserError(f"unknown option {key!r}")
        if key in RESUME_SAFE_OPTIONS or key in MACHINE_OPTIONS or key not in values:
            values[key] = value
            continue
        before, after = _comparable(key, values[key]), _comparable(key, value)
        if before != after:
            raise UserError(
                f"{option(key)} was {_shown(values[key])} in the run at {source} and is {_shown(value)} now; a "
                f"resumed run keeps it (to change it, start a new run from its weights and AdamW state with "
                f"{option('init_from', source)})"
            )
    try:
        return TrainConfig(**_typed(values))
    except TypeError as error:
        raise UserError(f"{source}: saved options do not fit this version of slide ({error})") from None


def _inside(path: Any, directory: Any) -> bool:
    if path is None or directory is None:
        return False
    return Path(str(path)).expanduser().resolve().is_relative_to(Path(str(directory)).expanduser().resolve())


def _typed(values: dict[str, Any]) -> dict[str, Any]:
    """Saved JSON values back to the field types (paths as Path, lists as tuples)."""
    typed = dict(values)
    for key in _PATH_FIELDS | {"data"}:
        if isinstance(typed.get(key), str):
            typed[key] = Path(typed[key])
    if isinstance(typed.get("data"), list):
        typed["data"] = tuple(Path(item) for item in typed["data"])
    if isinstance(typed.get("data_weights"), list):
        typed["data_weights"] = tuple(typed["data_weights"])
    if isinstance(typed.get("report_to"), list):
        typed["report_to"] = tuple(typed["report_to"])
    return typed


def _comparable(key: str, value: Any) -> Any:
    if value is None:
        return None
    if key == "data" and isinstance(value, list | tuple):
        return tuple(_comparable(key, item) for item in value) if len(value) > 1 else _comparable(key, value[0])
    if key == "data_weights":
        items = value.split(",") if isinstance(value, str) else value if isinstance(value, list | tuple) else [value]
        try:
            return tuple(float(item) for item in items)
        except (TypeError, ValueError):
            return value
    if key in _PATH_FIELDS or key in ("model", "data"):
        path = Path(str(value)).expanduser()
        # A preset name is not a path; compare it as text unless such a directory exists.
        return str(path.resolve()) if (key != "model" or path.exists()) else str(value)
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


def _shown(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return repr(value.value)
    return repr(str(value)) if isinstance(value, Path) else repr(value)
