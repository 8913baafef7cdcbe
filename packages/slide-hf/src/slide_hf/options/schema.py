"""How an option is declared: once, as a field of a config dataclass, with a :class:`Spec` in its metadata.

A field ``optimizer_state: StateFormat = option(StateFormat.FP32, help=..., commands=RUNS)`` is the whole
declaration of ``--optimizer-state``: its name (the same attribute in TOML, in ``slide_hf.train(...)`` and
on :class:`~slide_hf.options.TrainConfig`), its type and choices, its default (per command where the
commands differ), its help, which of `slide train`, `slide plan`, `slide bench` and `slide data` take it,
and whether the engine reads it (``engine=``: :class:`~slide_hf.setup.RunOptions` then carries it, converted
as declared there). The flag is derived from the name (dashes for underscores); the parsers
(:mod:`slide_hf.options.arguments`), the TOML loader (:mod:`slide_hf.options.toml`), the validation
(:mod:`slide_hf.options.validate`) and the engine's options (:mod:`slide_hf.options.engine`) walk these
declarations, so no command spells an option again.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from slide_hf.options.rules import Rule

__all__ = [
    "AS_DECLARED",
    "COMMANDS",
    "EVERY",
    "RUNS",
    "TRAIN",
    "Command",
    "DType",
    "DecayShape",
    "Declared",
    "DpoLoss",
    "EngineField",
    "LrSchedule",
    "MasterFormat",
    "Objective",
    "SaveDType",
    "Spec",
    "StateFormat",
    "UpdatePlacement",
    "declared",
    "option",
]

Command = Literal["train", "plan", "bench", "data"]
COMMANDS: tuple[Command, ...] = ("train", "plan", "bench", "data")
TRAIN: frozenset[Command] = frozenset({"train"})
RUNS: frozenset[Command] = frozenset({"train", "plan", "bench"})
"""The commands that run, plan or time a run: `slide data` only reads data, so it takes the data options alone."""
EVERY: frozenset[Command] = frozenset(COMMANDS)

_SPEC = "slide_hf.option"


class DType(enum.StrEnum):
    """The compute dtype. ``bf16`` and ``fp32`` (`slide plan`'s old spellings) are aliases."""

    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


DTYPE_ALIASES: Mapping[str, str] = types.MappingProxyType({"bf16": "bfloat16", "fp32": "float32"})


class SaveDType(enum.StrEnum):
    """The dtype of the exported model; ``auto`` keeps the model's own."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class StateFormat(enum.StrEnum):
    """How AdamW keeps exp_avg and exp_avg_sq between steps (docs/optimizer_state.md)."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"


class MasterFormat(enum.StrEnum):
    """How the host stores the fp32 master; ``auto`` is split where it can run."""

    AUTO = "auto"
    FP32 = "fp32"
    SPLIT = "split"


class UpdatePlacement(enum.StrEnum):
    """Where the AdamW update of a unit that is not device-resident runs (slide_hf/planner/plan.py)."""

    AUTO = "auto"
    HOST = "host"
    GPU = "gpu"


class LrSchedule(enum.StrEnum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"
    WSD = "wsd"
    COSINE_WITH_RESTARTS = "cosine_with_restarts"
    POLYNOMIAL = "polynomial"
    INVERSE_SQRT = "inverse_sqrt"


class DecayShape(enum.StrEnum):
    LINEAR = "linear"
    COSINE = "cosine"


class Objective(enum.StrEnum):
    """What a run optimizes (docs/preference.md): next-token cross-entropy, or a preference loss over pairs."""

    SFT = "sft"
    DPO = "dpo"
    SIMPO = "simpo"


class DpoLoss(enum.StrEnum):
    """DPO's loss on the reward margin, as TRL's ``loss_type`` names them: the paper's log-sigmoid, or IPO's
    squared distance to ``1 / (2 beta)``."""

    SIGMOID = "sigmoid"
    IPO = "ipo"


@dataclass(frozen=True)
class EngineField:
    """How the engine's options (:class:`~slide_hf.setup.RunOptions`, what `slide train` and `slide bench`
    set up the same way) take an option: as the field ``name`` (the option's own when ``None``), its value
    passed through ``convert`` (``--gpu-memory 24GiB`` is ``gpu_memory_bytes``, a number of bytes). The value
    arrives checked, so a conversion cannot fail on it."""

    name: str | None = None
    convert: Callable[[Any], Any] | None = None


AS_DECLARED = EngineField()
"""The engine takes the option under its own name and as the run holds it."""


@dataclass(frozen=True)
class Spec:
    """Everything about an option besides its name, type and default (the dataclass field's).

    - ``help``: may hold ``{default}`` and ``{choices}``, filled per command.
    - ``commands``: the commands whose parser takes the option (every option is a TOML key and a
      ``slide_hf.train`` keyword when it is a :class:`TrainConfig` field).
    - ``rule``: the range a number must lie in; ``choices`` (an enum) or ``plugins`` (an entry-point
      group, with ``builtin`` names beside the installed ones) for names.
    - ``aliases``: other spellings users have written, mapped to the canonical value.
    - ``defaults``, ``helps``, ``required``: where a command differs from `slide train`.
    - ``flag``, ``action``, ``metavar``: how argparse shows it, when not ``--name VALUE``.
    - ``engine``: the engine reads it (:mod:`slide_hf.options.engine`); ``None``: only the recipe around the
      engine does (data, schedule, saving), or only a planning command.
    """

    help: str
    commands: frozenset[Command] = TRAIN
    rule: Rule | None = None
    choices: type[enum.StrEnum] | None = None
    plugins: str | None = None
    builtin: tuple[str, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[Command, Any] = field(default_factory=dict)
    helps: Mapping[Command, str] = field(default_factory=dict)
    required: frozenset[Command] = frozenset()
    flag: str | None = None
    action: Literal["store_true", "store_false", "append"] | None = None
    metavar: str | None = None
    engine: EngineField | None = None

    def value_rule(self) -> Rule | None:
        """The rule one value must pass: the choices, the installed plugins, or the numeric range."""
        if self.choices is not None:
            return Rule("choice", choices=tuple(member.value for member in self.choices))
        if self.plugins is not None:
            return Rule("plugin", choices=self.builtin, group=self.plugins)
        return self.rule


def option(default: Any, *, help: str, **spec: Any) -> Any:
    """A dataclass field that declares an option (see the module docstring). Typed ``Any`` so the field's
    own annotation stays the option's type for the type checker."""
    return field(default=default, metadata={_SPEC: Spec(help=help, **spec)})


@dataclass(frozen=True)
class Declared:
    """One declared option, as the parsers, the TOML loader and the validation walk it."""

    name: str
    default: Any
    spec: Spec
    hint: Any
    """The field's resolved type annotation (``int | None``, ``Path``, ``DType``)."""

    @property
    def flag(self) -> str:
        return self.spec.flag or "--" + self.name.replace("_", "-")

    def takes(self, command: Command) -> bool:
        return command in self.spec.commands

    @property
    def engine_name(self) -> str | None:
        """The engine's name for the option (:class:`EngineField`), ``None`` where the engine does not read it."""
        if self.spec.engine is None:
            return None
        return self.spec.engine.name or self.name

    def engine_value(self, value: Any) -> Any:
        """``value`` (checked, canonical) as the engine takes it."""
        convert = self.spec.engine.convert if self.spec.engine is not None else None
        return value if convert is None else convert(value)

    def default_for(self, command: Command) -> Any:
        return self.spec.defaults.get(command, self.default)

    def normalised(self, value: Any) -> Any:
        """``value`` in its canonical spelling: an alias resolved, a choice as its enum member; anything
        else unchanged (the rule then names it)."""
        if isinstance(value, str) and not isinstance(value, enum.Enum):
            value = self.spec.aliases.get(value, value)
            if self.spec.choices is not None and value in self.spec.choices._value2member_map_:
                return self.spec.choices(value)
        return value

    def cli_type(self) -> Callable[[str], Any] | None:
        """What argparse converts the text with: the scalar type of the field (``str`` for names, sizes
        and lists the config parses itself)."""
        if self.spec.action is not None:
            return None
        members = typing.get_args(self.hint) or (self.hint,)
        if str in members or any(_is_enum(m) or typing.get_origin(m) is tuple for m in members):
            return None
        for kind in (int, float, Path):
            if kind in members:
                return kind
        return None

    def metavar(self) -> str | None:
        if self.spec.metavar is not None:
            return self.spec.metavar
        if self.spec.choices is not None:
            return "{" + ",".join(member.value for member in self.spec.choices) + "}"
        if self.spec.plugins is not None:
            return "NAME"
        return None

    def help_for(self, command: Command) -> str:
        text = self.spec.helps.get(command, self.spec.help)
        return text.format(default=_shown(self.default_for(command)), choices=self._choices_text())

    def _choices_text(self) -> str:
        """``"auto, cpu, cuda"``: what the option accepts here, for --help (which must render even when
        package metadata cannot be read: then it says where to look)."""
        rule = self.spec.value_rule()
        if rule is None or rule.kind not in ("choice", "plugin"):
            return ""
        try:
            return ", ".join(rule.names())
        except Exception:  # unreadable metadata must not break every command's parser
            return "see `slide doctor`"


def _is_enum(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, enum.Enum)


def _shown(value: Any) -> str:
    return str(value.value) if isinstance(value, enum.Enum) else str(value)


def taken_by(cls: type[Any], command: Command) -> frozenset[str]:
    """The options of ``cls`` that ``command`` takes, read from the fields' declarations alone (no type
    hints: the option rules ask this on every check)."""
    return frozenset(
        item.name
        for item in dataclasses.fields(cls)
        if _SPEC in item.metadata and command in item.metadata[_SPEC].commands
    )


def default_of(cls: type[Any], name: str) -> Any:
    """The declared default of ``cls``'s option ``name``."""
    return next(item.default for item in dataclasses.fields(cls) if item.name == name)


def declared(cls: type[Any]) -> tuple[Declared, ...]:
    """Every option ``cls`` declares, in field order."""
    hints = typing.get_type_hints(cls)
    return tuple(
        Declared(item.name, item.default, item.metadata[_SPEC], hints[item.name])
        for item in dataclasses.fields(cls)
        if _SPEC in item.metadata
    )
