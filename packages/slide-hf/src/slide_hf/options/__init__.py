"""The options of a run, declared once: one schema for `slide train`, `slide plan`, `slide bench`, `slide data`,
the TOML file, ``slide_hf.train`` and the engine's options.

- :mod:`.schema`: how an option is declared (a dataclass field with a :class:`Spec`) and its enums;
- :mod:`.config`: :class:`TrainConfig`, whose fields are the declarations, and the one-value checks;
- :mod:`.validate`: every rule that relates several options, behind :meth:`TrainConfig.validate`;
- :mod:`.arguments`: each command's flags, generated from the declarations;
- :mod:`.engine`: the options the engine reads (slide_hf.setup.RunOptions), generated from the declarations;
- :mod:`.toml`: the ``--config`` file's keys;
- :mod:`.resume`: the options saved with a run, and those of a run that resumes it.
"""

from __future__ import annotations

from slide_hf.options.arguments import add_options, command_options, given_options
from slide_hf.options.config import (
    OPTIMIZER_ALIASES,
    REPORTERS,
    RULES,
    Launch,
    TrainConfig,
    check_option,
    data_sources,
    default_lr,
    installed_names,
    train_options,
)
from slide_hf.options.engine import engine_options, engine_values
from slide_hf.options.resume import MACHINE_OPTIONS, RESUME_SAFE_OPTIONS, config_dict, resume_config
from slide_hf.options.rules import Rule
from slide_hf.options.schema import (
    COMMANDS,
    Command,
    DecayShape,
    Declared,
    DType,
    EngineField,
    LrSchedule,
    MasterFormat,
    SaveDType,
    Spec,
    StateFormat,
)
from slide_hf.options.toml import toml_options
from slide_hf.options.validate import CROSS_RULES, check_adamw, validate

__all__ = [
    "COMMANDS",
    "CROSS_RULES",
    "MACHINE_OPTIONS",
    "OPTIMIZER_ALIASES",
    "REPORTERS",
    "RESUME_SAFE_OPTIONS",
    "RULES",
    "Command",
    "DType",
    "DecayShape",
    "Declared",
    "EngineField",
    "Launch",
    "LrSchedule",
    "MasterFormat",
    "Rule",
    "SaveDType",
    "Spec",
    "StateFormat",
    "TrainConfig",
    "add_options",
    "check_adamw",
    "check_option",
    "command_options",
    "config_dict",
    "data_sources",
    "default_lr",
    "engine_options",
    "engine_values",
    "given_options",
    "installed_names",
    "resume_config",
    "toml_options",
    "train_options",
    "validate",
]
