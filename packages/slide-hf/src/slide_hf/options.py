"""The options of a training run, and the one layer that validates them.

Every way into `slide train` -- flags, a TOML file, the Python API, a resumed run's saved options -- ends in
:class:`TrainConfig`, and its ``__post_init__`` applies :data:`RULES`. So a value is checked once, in one
place, with one message per option: ``--lr must be a finite number >= 0, got nan``. NaN and infinities
are refused for every float (an all-NaN model exported with exit 0 is the worst outcome a user can get), and
every integer has a range that the code behind it can honour (a seed past 2**63 cannot seed torch).

Resuming (:func:`resume_config`) restores the saved options and lets the command line change only what
cannot change the math of the run: how long it goes on, how often it saves, evaluates and logs, and where
it runs. Anything else differing from the saved run is refused in one line naming both values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from slide_hf.errors import UserError
from slide_hf.spelling import option

__all__ = [
    "MACHINE_OPTIONS",
    "REPORTERS",
    "RESUME_SAFE_OPTIONS",
    "RULES",
    "Rule",
    "TrainConfig",
    "check_adamw",
    "check_data_parallel",
    "check_option",
    "config_dict",
    "data_sources",
    "default_lr",
    "installed_names",
    "resume_config",
]

_INT_MAX = 2**63 - 1
_FP32_TINY = 1.1754943508222875e-38
"""The smallest normal fp32 number: an --adam-eps below it rounds to 0 (or a subnormal) in the fp32 update,
and a zero second moment then divides 0 by 0."""
REPORTERS = ("tensorboard", "wandb", "mlflow")


@dataclass(frozen=True)
class Rule:
    """What one option accepts: a finite number in ``[low, high]`` (``low_open``: strictly above ``low``,
    ``high_open``: strictly below ``high``), one of ``choices``, or (kind ``"plugin"``) one of ``choices``
    or a name installed in the entry-point ``group``, read when the value is checked, never hard-coded."""

    kind: str  # "int", "float", "choice" or "plugin"
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()
    group: str | None = None

    def names(self) -> tuple[str, ...]:
        """What a choice or plugin option accepts now: ``choices`` first, then the installed plugins."""
        if self.kind != "plugin" or self.group is None:
            return self.choices
        from slide_core import plugins

        return self.choices + tuple(name for name in plugins.available(self.group) if name not in self.choices)

    def describe(self) -> str:
        """``in [0, 1)``, ``>= 0``, ``an integer in [1, 64]``: interval notation, as the docs write ranges."""
        if self.kind in ("choice", "plugin"):
            return "one of " + ", ".join(self.names())
        noun = "an integer" if self.kind == "int" else "a finite number"
        low, high = self.low, self.high
        if self.kind == "int":
            low, high = (None if low is None else int(low)), (None if high is None else int(high))
        shown_high = high is not None and (self.kind == "float" or high < 2**31)
        if low is not None and shown_high:
            return f"{noun} in {'(' if self.low_open else '['}{_num(low)}, {_num(high)}{')' if self.high_open else ']'}"
        if low is not None:
            return f"{noun} {'>' if self.low_open else '>='} {_num(low)}"
        return noun

    def accepts(self, value: Any) -> bool:
        if self.kind in ("choice", "plugin"):  # a listed choice needs no look at the installed plugins
            return isinstance(value, str) and (value in self.choices or value in self.names())
        if isinstance(value, bool):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        if not isinstance(value, int | float) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def out_of_range_word(self, value: Any) -> str:
        """``" (too large)"`` for an integer past a bound the message does not print; for a plugin that is
        not installed but well known, ``"; `nvme` needs slide-io: pip install slide-io"``."""
        if self.kind == "plugin" and self.group is not None and isinstance(value, str):
            from slide_core import plugins

            hint = plugins.install_hint(self.group, value)
            return f"; {hint}" if hint else ""
        big = self.kind == "int" and isinstance(value, int) and self.high is not None and value > self.high
        return " (too large)" if big and self.high >= 2**31 else ""


def _num(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _positive_int(high: float = _INT_MAX) -> Rule:
    return Rule("int", 1, high)


RULES: dict[str, Rule] = {
    "device": Rule("plugin", choices=("auto",), group="slide.devices"),
    "optimizer": Rule("plugin", choices=("auto",), group="slide.optimizers"),
    "optimizer_state": Rule("choice", choices=("fp32", "bf16", "int8")),
    "master": Rule("choice", choices=("auto", "fp32", "split")),
    "dtype": Rule("choice", choices=("bfloat16", "float32")),
    "seq_len": Rule("int", 2, 2**24),
    "batch_size": _positive_int(),
    "grad_accum": _positive_int(),
    "steps": _positive_int(_INT_MAX),
    "epochs": _positive_int(10**6),
    "lr": Rule("float", 0),
    "weight_decay": Rule("float", 0),
    "adam_beta1": Rule("float", 0, 1, high_open=True),
    "adam_beta2": Rule("float", 0, 1, high_open=True),
    "adam_eps": Rule("float", _FP32_TINY, 1),
    "lr_schedule": Rule("choice", choices=("constant", "linear", "cosine", "wsd")),
    "min_lr_ratio": Rule("float", 0, 1, high_open=True),
    "decay_fraction": Rule("float", 0, 1, low_open=True),
    "decay_shape": Rule("choice", choices=("linear", "cosine")),
    "warmup_steps": Rule("int", 0, _INT_MAX),
    "max_grad_norm": Rule("float", 0),
    "seed": Rule("int", 0, _INT_MAX),
    "save_every": Rule("int", 0, _INT_MAX),
    "keep_checkpoints": _positive_int(10**6),
    "offload_optimizer": Rule("plugin", choices=("ram",), group="slide.tiers"),
    "nvme_fraction": Rule("float", 0, 1),
    "offload_activations": Rule("choice", choices=("ram", "nvme")),
    "save_dtype": Rule("choice", choices=("auto", "float32", "bfloat16")),
    "block_slots": Rule("int", 1, 64),
    "eval_fraction": Rule("float", 0, 1, high_open=True),
    "eval_every": Rule("int", 0, _INT_MAX),
    "log_every": _positive_int(_INT_MAX),
}
"""Option name (underscored, as in TOML and the Python API) -> what it accepts. ``None`` always passes
where the field allows it (``steps``, ``epochs``, ``lr``: "choose for me")."""


def installed_names(name: str) -> str:
    """``"auto, cpu, cuda, rocm"``: what the plugin-backed option ``name`` accepts here, for --help texts
    (which must render even when package metadata cannot be read: then it says where to look)."""
    try:
        return ", ".join(RULES[name].names())
    except Exception:  # unreadable metadata must not break every command's parser
        return "see `slide doctor`"


def check_option(name: str, value: Any, *, flag: str | None = None) -> None:
    """Refuse ``value`` for option ``name`` in one line, unless :data:`RULES` accepts it.

    ``flag`` is how the caller's user wrote the option (``--gpu-memory``); the default is ``--name-with-dashes``.
    `slide plan` and `slide bench` call this for the options they share with `slide train`."""
    rule = RULES[name]
    if value is None or rule.accepts(value):
        return
    shown = flag or option(name)
    raise UserError(f"{shown} must be {rule.describe()}, got {value!r}{rule.out_of_range_word(value)}")


def check_adamw(lr: float | None, weight_decay: float, *, default_lr: float | None = None) -> None:
    """Refuse a weight decay that flips the weights' sign: AdamW scales each weight by ``1 - lr * wd`` per
    step, so ``lr * wd`` must stay below 1 (past it every step negates and grows the weights, and the run
    fails steps later with a message about the loss). ``default_lr`` is the lr used when ``lr`` is None."""
    rate = lr if lr is not None else default_lr
    if rate is None or weight_decay == 0 or rate * weight_decay < 1:
        return
    shown = f"--lr {rate:g}" if lr is not None else f"the default --lr {rate:g}"
    raise UserError(
        f"--weight-decay {weight_decay:g} with {shown} scales every weight by 1 - lr * wd = "
        f"{1 - rate * weight_decay:g} per step; lr * wd must be below 1 (a weight decay is usually 0.0-0.1)"
    )


def check_data_parallel(optimizer_state: str, processes: int) -> None:
    """Refuse, in one line and before any process starts, what a data-parallel run cannot do yet: int8 Adam
    state (a rank's shard of a unit could split one of its 64-element blocks, whose scale is shared).
    `slide train` (before launching and in every rank) and `slide plan --nproc-per-node` call this."""
    if processes > 1 and optimizer_state == "int8":
        raise UserError(
            f"--optimizer-state int8 does not run with data parallel ({processes} processes) yet: a rank's shard "
            "could split one of its 64-element blocks; use --optimizer-state bf16 or fp32"
        )


@dataclass(frozen=True)
class TrainConfig:
    """Every `slide train` option, with the same names (underscores) as the flags and the TOML file.

    ``None`` where a field allows it means "choose for me": ``steps``/``epochs`` (one epoch, or the demo's),
    ``lr``, and ``seq_len`` (2048, or the model's context length if shorter; see slide_hf/defaults.py)."""

    model: str = "tiny-llama"
    tokenizer: Path | None = None
    data: Path | tuple[Path, ...] | None = None
    data_weights: tuple[float, ...] | None = None
    max_record_size: str | int | None = None
    output: Path | None = None
    overwrite: bool = False
    device: str = "auto"
    dtype: str = "bfloat16"
    seq_len: int | None = None  # None: slide_hf.defaults.resolve_seq_len, once the model is known
    packing: bool = True
    train_on_inputs: bool = False
    chat_template: str | None = None
    batch_size: int = 4
    grad_accum: int = 1
    steps: int | None = None
    epochs: int | None = None
    lr: float | None = None
    weight_decay: float = 0.0
    optimizer: str = "auto"
    optimizer_state: str = "fp32"
    master: str = "fp32"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    lr_schedule: str = "linear"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    decay_fraction: float = 0.1
    decay_shape: str = "linear"
    allow_data_change: bool = False
    max_grad_norm: float = 0.0
    seed: int = 0
    no_shuffle: bool = False
    eval_data: Path | None = None
    eval_fraction: float = 0.0
    eval_every: int = 0
    save_best: bool = False
    metrics: Path | None = None
    report_to: tuple[str, ...] = ()
    log_every: int = 1
    save_every: int = 0
    keep_checkpoints: int = 2
    resume: Path | None = None
    gpu_memory: str | int | float | None = None
    offload_optimizer: str = "ram"
    nvme_dir: Path | None = None
    nvme_fraction: float = 1.0
    offload_activations: str = "ram"
    save_dtype: str = "auto"
    block_slots: int = 2

    def __post_init__(self) -> None:
        _normalise_data(self)
        for name in sorted(_PATH_FIELDS):
            value = getattr(self, name)
            if isinstance(value, str):
                if not value.strip():
                    raise UserError(f"{option(name)} must not be empty")
                object.__setattr__(self, name, Path(value))
        for name in RULES:
            check_option(name, getattr(self, name))
        if isinstance(self.report_to, str):
            object.__setattr__(self, "report_to", _split_reporters(self.report_to))
        unknown = [name for name in self.report_to if name not in REPORTERS]
        if unknown:
            raise UserError(
                f"{option('report_to')} must name {', '.join(REPORTERS)}; got {', '.join(map(repr, unknown))}"
            )
        from slide_hf.sizes import parse_size

        for name in ("gpu_memory", "max_record_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or (value is not None and not isinstance(value, str | int | float)):
                raise UserError(f"{option(name)} must be a size such as 24GiB, got {value!r}")
            if value is not None:  # a plain number (a TOML 24) is GiB, as on the command line
                object.__setattr__(self, name, str(value))
                parse_size(str(value), what=option(name))
        check_adamw(self.lr, self.weight_decay)
        if self.eval_data is not None and self.eval_fraction > 0:
            raise UserError(
                f"{option('eval_data')} and {option('eval_fraction')} both choose the evaluation data; give one"
            )
        if self.save_best and not self.evaluates:
            raise UserError(
                f"{option('save_best')} needs evaluation data: {option('eval_data', 'FILE')} or "
                f"{option('eval_fraction', 'F')}"
            )
        if self.min_lr_ratio > 0 and self.lr_schedule == "constant":
            raise UserError(
                f"{option('min_lr_ratio')} is the floor of a decay; {option('lr_schedule', 'constant')} has none "
                "(use linear, cosine or wsd)"
            )
        if self.master == "split" and self.dtype != "bfloat16":
            raise UserError(
                f"--master split stores the bf16 copy the GPU computes with, so it needs --dtype bfloat16, got "
                f"{self.dtype}; use --master fp32 or auto"
            )

    @property
    def evaluates(self) -> bool:
        return self.eval_data is not None or self.eval_fraction > 0

    @property
    def max_record_bytes(self) -> int:
        """``--max-record-size`` in bytes (default 8 MiB, docs/data.md)."""
        from slide_hf.data.readers import DEFAULT_MAX_RECORD_BYTES
        from slide_hf.sizes import parse_size

        if self.max_record_size is None:
            return DEFAULT_MAX_RECORD_BYTES
        return parse_size(str(self.max_record_size), what="--max-record-size")


_PATH_FIELDS = frozenset({"tokenizer", "output", "eval_data", "metrics", "resume", "nvme_dir"})


def _normalise_data(cfg: TrainConfig) -> None:
    """``data``: one source as a Path, several (a mixture) as a tuple of Paths; ``data_weights``: a tuple
    of positive finite numbers, one per source (``"3,1"`` from the command line, a list from TOML)."""
    data = cfg.data
    items = list(data) if isinstance(data, list | tuple) else ([] if data is None else [data])
    for item in items:
        if not isinstance(item, str | Path) or not str(item).strip():
            raise UserError(f"--data must name a file, a datasets directory or a Hub dataset, got {item!r}")
    if isinstance(data, list | tuple) and not items:
        raise UserError("--data must name at least one source")
    paths = tuple(Path(item) for item in items)
    object.__setattr__(cfg, "data", None if not paths else paths[0] if len(paths) == 1 else paths)
    weights = cfg.data_weights
    if weights is None:
        return
    if isinstance(weights, str):
        weights = [part.strip() for part in weights.split(",")]
    if not isinstance(weights, list | tuple):
        weights = [weights]
    parsed = []
    for weight in weights:
        try:
            value = float(weight) if not isinstance(weight, bool) else math.nan
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise UserError(f"--data-weights must be positive finite numbers, one per --data, got {weight!r}")
        parsed.append(value)
    if len(parsed) != len(paths):
        raise UserError(f"--data-weights gives {len(parsed)} weight(s) for {len(paths)} --data source(s)")
    object.__setattr__(cfg, "data_weights", tuple(parsed))


def data_sources(cfg: TrainConfig) -> tuple[Path, ...]:
    """The run's ``--data`` sources (empty for the bundled text)."""
    return cfg.data if isinstance(cfg.data, tuple) else () if cfg.data is None else (cfg.data,)


def _split_reporters(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


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
        elif isinstance(value, tuple):
            value = list(value)
        values[key] = value
    return values


_INPUTS = frozenset({"model", "tokenizer", "data", "eval_data", "chat_template", "nvme_dir"})


def _saved_input(value: Path) -> str:
    path = value.expanduser()
    return str(path.resolve()) if path.exists() else str(value)


RESUME_SAFE_OPTIONS = frozenset(
    {
        "steps",
        "epochs",
        "save_every",
        "keep_checkpoints",
        "eval_every",
        "save_best",
        "metrics",
        "report_to",
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
    }
)
"""Options that say where the run executes. A resumed run may change them (it may land on another machine);
placement moves arrays between host, GPU and disk, and ``master`` stores the same fp32 values another way
(checkpoints hold them in fp32 either way): neither changes what the arrays hold."""


_NOT_RESTORED = frozenset({"output", "overwrite", "resume", "allow_data_change"})
"""What belongs to one invocation: where it was, and what it allowed (replacing a directory, training on
changed data). A later resume asks again."""


def default_lr(from_preset: bool) -> float:
    """The peak lr when none is given: 1e-3 for a preset's random init, 2e-5 to fine-tune real weights.
    The recipe resolves it once and saves the number, so a resume compares numbers, never ``None``."""
    return 1e-3 if from_preset else 2e-5


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
    for key, value in given.items():
        if key not in known:
            raise UserError(f"unknown option {key!r}")
        if key in RESUME_SAFE_OPTIONS or key in MACHINE_OPTIONS or key not in values:
            values[key] = value
            continue
        before, after = _comparable(key, values[key]), _comparable(key, value)
        if before != after:
            raise UserError(
                f"{option(key)} was {_shown(values[key])} in the run at {source} and is {_shown(value)} now; a "
                f"resumed run keeps it (start a new run with {option('output')} to change it)"
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
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


def _shown(value: Any) -> str:
    return repr(str(value)) if isinstance(value, Path) else repr(value)
