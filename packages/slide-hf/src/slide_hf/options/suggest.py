"""The option a user meant by a name that is none: a TOML key or a ``slide_hf.train`` keyword.

A wrong name is refused (never ignored: a ``learning_rate = 1e-4`` that trained at the default lr would
waste the run), and the refusal names the right one, found in this order:

1. the same name spelled as a flag (``no-packing``, ``--lr``): keys are the fields' underscored names;
2. a switch written as its opposite: ``--no-packing`` is the key ``packing`` (``no_packing = true`` means
   ``packing = false``), and ``shuffle = false`` is ``no_shuffle = true``;
3. the name other trainers give the option (HF ``TrainingArguments``, TRL, Axolotl, torchtune):
   ``learning_rate`` is ``lr``, ``max_steps`` is ``steps``;
4. the closest name (``warmup_step`` is ``warmup_steps``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Literal

from slide_hf.errors import UnknownOption

__all__ = ["FOREIGN_NAMES", "Suggestion", "suggest", "unknown_option"]

FOREIGN_NAMES: dict[str, str] = {
    "learning_rate": "lr",
    "lr_scheduler_type": "lr_schedule",
    "lr_scheduler": "lr_schedule",
    "scheduler": "lr_schedule",
    "max_steps": "steps",
    "num_steps": "steps",
    "num_train_epochs": "epochs",
    "num_epochs": "epochs",
    "per_device_train_batch_size": "batch_size",
    "micro_batch_size": "batch_size",
    "train_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "gradient_accumulation": "grad_accum",
    "max_seq_length": "seq_len",
    "max_seq_len": "seq_len",
    "sequence_len": "seq_len",
    "max_length": "seq_len",
    "output_dir": "output",
    "model_name_or_path": "model",
    "base_model": "model",
    "dataset": "data",
    "datasets": "data",
    "train_file": "data",
    "eval_file": "eval_data",
    "eval_dataset": "eval_data",
    "val_set_size": "eval_fraction",
    "eval_steps": "eval_every",
    "save_steps": "save_every",
    "logging_steps": "log_every",
    "save_total_limit": "keep_checkpoints",
    "load_best_model_at_end": "save_best",
    "num_warmup_steps": "warmup_steps",
    "warmup": "warmup_steps",
    "adam_epsilon": "adam_eps",
    "gradient_clipping": "max_grad_norm",
    "clip_grad_norm": "max_grad_norm",
    "resume_from_checkpoint": "resume",
    "sample_packing": "packing",
    "optim": "optimizer",
    "torch_dtype": "dtype",
    "tokenizer_name": "tokenizer",
    "cosine_min_lr_ratio": "min_lr_ratio",
}
"""Other trainers' names for an option, to ours."""

_LAUNCH = frozenset({"nproc_per_node"})
"""`slide train`'s flags that start processes: neither TOML keys nor keywords (slide_hf/options/config.py)."""

Style = Literal["toml", "keyword"]


@dataclass(frozen=True)
class Suggestion:
    """The option meant, and for a switch written as its opposite the value that says the same."""

    name: str
    value: bool | None = None

    def shown(self, style: Style) -> str:
        """``'lr'``; ``packing = false`` in TOML, ``packing=False`` as a keyword."""
        if self.value is None:
            return repr(self.name)
        if style == "toml":
            return f"`{self.name} = {str(self.value).lower()}`"
        return f"{self.name}={self.value}"


def suggest(key: str, value: Any, switches: dict[str, bool]) -> Suggestion | None:
    """The option ``key`` (given ``value``) most likely meant, among ``switches`` (every option's name ->
    whether it is a switch, a ``bool``), or None."""
    name = key.strip().lstrip("-").replace("-", "_").lower()
    flipped = (not value) if isinstance(value, bool) else None
    if name in switches and name != key:
        return Suggestion(name)
    if name.startswith("no_") and switches.get(name.removeprefix("no_")):  # --no-packing: packing = false
        return Suggestion(name.removeprefix("no_"), flipped)
    if switches.get("no_" + name):  # shuffle = false: no_shuffle = true
        return Suggestion("no_" + name, flipped)
    if name in FOREIGN_NAMES:
        return Suggestion(FOREIGN_NAMES[name])
    close = difflib.get_close_matches(name, list(switches), n=1, cutoff=0.75)
    return Suggestion(close[0]) if close else None


def unknown_option(key: str, value: Any, *, style: Style) -> UnknownOption:
    """The error for option ``key`` that does not exist: it names ``key`` and, where one is near, the
    option meant (``unknown option 'learning_rate'; did you mean 'lr'?``)."""
    from slide_hf.options.config import train_options

    message = f"unknown option {key!r}"
    if key.replace("-", "_") in _LAUNCH:
        flag = "--" + key.replace("_", "-")
        return UnknownOption(f"{message}; {flag} is a flag of `slide train` alone: it starts the processes")
    switches = {item.name: item.hint is bool for item in train_options()}
    found = suggest(key, value, switches)
    if found is not None:
        return UnknownOption(f"{message}; did you mean {found.shown(style)}?")
    where = "TOML keys" if style == "toml" else "keywords"
    return UnknownOption(f"{message}; the {where} are `slide train --help`'s options, with underscores")
