"""The options of a training run: :class:`TrainConfig`, each field the one declaration of an option.

Every way into `slide train` -- flags, a TOML file, the Python API, a resumed run's saved options -- ends in
:class:`TrainConfig`, and `slide plan`, `slide bench` and `slide data` build one from the options they share
with it; the engine's options (slide_hf/setup.py's ``RunOptions``) are generated from it (``engine=``). Its
``__post_init__`` puts every value in its canonical spelling (``bf16`` is ``bfloat16``), checks each one
against its rule (one line per option: ``--lr must be a finite number >= 0, got nan``; NaN and infinities
are refused for every float, every integer has a range the code behind it can honour), then applies the
cross-option rules through :meth:`TrainConfig.validate`.
"""

# ruff: noqa: RUF009 -- `option(...)` returns a dataclasses.field (slide_hf/options/schema.py), not a shared default

from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slide_hf.data.options import SystemMessage
from slide_hf.defaults import DEFAULT_SEQ_LEN, DEFAULT_SEQ_TILE, DEMO_SEQ_LEN
from slide_hf.errors import UserError
from slide_hf.options.rules import FP32_TINY, INT_MAX, Rule, positive_int
from slide_hf.options.schema import (
    AS_DECLARED,
    DTYPE_ALIASES,
    EVERY,
    RUNS,
    Command,
    DecayShape,
    Declared,
    DpoLoss,
    DType,
    EngineField,
    LrSchedule,
    MasterFormat,
    Objective,
    SaveDType,
    StateFormat,
    UpdatePlacement,
    declared,
    option,
)
from slide_hf.options.sources import data_sources
from slide_hf.spelling import option as spelled

if TYPE_CHECKING:
    import torch

__all__ = [
    "OPTIMIZER_ALIASES",
    "REPORTERS",
    "RULES",
    "Launch",
    "TrainConfig",
    "check_option",
    "data_sources",
    "default_lr",
    "installed_names",
    "train_options",
]

REPORTERS = ("tensorboard", "wandb", "mlflow")
OPTIMIZER_ALIASES = {"torch": "torch-adamw", "fused": "fused-adamw"}
"""The names `slide bench --optimizer` took before optimizers were plugins."""

_TRAIN_PLAN: frozenset[Command] = frozenset({"train", "plan"})
_TRAIN_BENCH: frozenset[Command] = frozenset({"train", "bench"})
_TRAIN_DATA: frozenset[Command] = frozenset({"train", "data"})
_COMMAND: ContextVar[Command] = ContextVar("slide_hf_options_command", default="train")
"""The command a :class:`TrainConfig` is being built for (:meth:`TrainConfig.for_command`): it belongs to the
call, as slide_hf/spelling.py's choice of spelling does, and is `slide train` outside it."""
_MASTER_HELP = (
    "how the host stores the fp32 master: split (a bf16 plane the GPU copies as it is, half the host-to-device "
    "bytes, plus the low 16 bits and a tie bit: exact; bf16 only), fp32 (one fp32 slab), or auto (default: split "
    "when it can run, else fp32)"
)


def _size_bytes(size: str | None) -> int | None:
    """``--gpu-memory`` (checked, kept as its text: ``24``, ``24GiB``) in bytes, as the device caps it."""
    from slide_hf.sizes import parse_size

    return None if size is None else parse_size(size)


def _enum_value(choice: Enum) -> str:
    """An enum option as the engine's setup reads it: its value."""
    return str(choice.value)


def _torch_dtype(dtype: DType | None) -> torch.dtype:
    """``--dtype`` as the engine computes in: the torch dtype of the same name (torch is imported only
    when a run is set up, never for a command's --help). ``None`` (none chosen) is bfloat16: `slide bench`
    takes no ``--dtype`` and measures the GPU's bf16 path; `slide train` chooses one for its device before
    the engine's options are built (slide_hf/device_defaults.py)."""
    import torch

    return torch.bfloat16 if dtype is None else getattr(torch, dtype.value)


@dataclass(frozen=True)
class TrainConfig:
    """Every `slide train` option, with the same names (underscores) as the flags, the TOML file and the
    keywords of ``slide_hf.train``.

    ``None`` where a field allows it means "choose for me": ``steps``/``epochs`` (one epoch, or the demo's),
    ``lr``, ``seq_len`` (2048, or the model's context length if shorter; see slide_hf/defaults.py) and
    ``dtype`` (the device's: see slide_hf/device_defaults.py)."""

    model: str = option(
        "tiny-llama",
        help="HF model directory, Hub name (org/name) or preset (default {default})",
        helps={"plan": "HF model directory or preset name"},
        commands=EVERY,
        defaults={"bench": "llama3.2-3b"},
        required=frozenset({"plan"}),
    )
    tokenizer: Path | None = option(
        None, help="tokenizer directory, when the model directory has none", commands=_TRAIN_DATA
    )
    data: Path | tuple[Path, ...] | None = option(
        None,
        help="JSON Lines (.jsonl, .jsonl.gz), .json, .parquet or a Hub dataset (default: bundled text); repeat it "
        "to train on several sources (concatenated, or sampled by --data-weights)",
        commands=_TRAIN_DATA,
        action="append",
    )
    data_weights: tuple[float, ...] | None = option(
        None,
        help="sampling proportions of the --data sources, one positive number each (e.g. 3,1): seeded, resumable",
        commands=_TRAIN_DATA,
        metavar="W1,W2,...",
    )
    max_record_size: str | int | None = option(
        None,
        help="refuse a record (a JSON line or object) larger than this before parsing it (default 8MiB)",
        commands=_TRAIN_DATA,
        metavar="SIZE",
    )
    output: Path | None = option(
        None,
        help="output directory (default runs/<timestamp>-<suffix>)",
        helps={"plan": "slide train's output directory (default runs/): its disk's measured write rate prices saves"},
        commands=_TRAIN_PLAN,
    )
    overwrite: bool = option(False, help="reuse a non-empty --output, replacing slide's files", action="store_true")
    device: str = option(
        "auto",
        help="compute device, one of {choices} (default auto: cuda, rocm on a HIP build of torch, else cpu)",
        helps={
            "plan": "the device whose memory is the GPU budget without --gpu-memory, one of {choices} "
            "(default auto, as slide train)"
        },
        commands=RUNS,
        plugins="slide.devices",
        engine=AS_DECLARED,
        builtin=("auto",),
    )
    dtype: DType | None = option(
        None,
        help="compute dtype (default: bfloat16 on a GPU and on a CPU with native bfloat16, else float32; bf16 and "
        "fp32 are accepted too)",
        commands=_TRAIN_PLAN,
        choices=DType,
        aliases=DTYPE_ALIASES,
        engine=EngineField("compute_dtype", _torch_dtype),
    )
    seq_len: int | None = option(
        None,
        help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}, or the model's context length if shorter; "
        f"{DEMO_SEQ_LEN} on the bundled demo text)",
        helps={
            "plan": f"tokens per sequence (default {DEFAULT_SEQ_LEN}, or the model's context length if shorter)",
            "bench": f"tokens per sequence (default {DEFAULT_SEQ_LEN}, or the model's context length if shorter)",
        },
        commands=EVERY,
        rule=Rule("int", 2, 2**24),
        engine=AS_DECLARED,
    )
    packing: bool = option(
        True,
        help="one example per row (padded)",
        helps={"plan": "plan rows of one example each (packed rows need (S x S) attention masks without flash-attn)"},
        commands=frozenset({"train", "data", "plan"}),
        flag="--no-packing",
        action="store_false",
    )
    train_on_inputs: bool = option(
        False, help="loss on prompts and user turns too", commands=_TRAIN_DATA, action="store_true"
    )
    chat_template: str | None = option(
        None,
        help="chat template file (.jinja) or a bundled name, instead of the tokenizer's",
        commands=_TRAIN_DATA,
        metavar="FILE|NAME",
    )
    keep_reasoning: bool = option(
        False,
        help="train every reply's reasoning: Qwen3's template keeps only the replies' after the last user query "
        "(as at inference); this renders each reply's <think> block, as TRL's Qwen3 training template",
        commands=_TRAIN_DATA,
        action="store_true",
    )
    system_message: SystemMessage = option(
        SystemMessage.FOLD,
        help="when the chat template refuses a system message (Gemma's): fold it into the first user turn, "
        "or refuse the conversation (default {default})",
        commands=_TRAIN_DATA,
        choices=SystemMessage,
    )
    objective: Objective = option(
        Objective.SFT,
        help="what to train: sft (next-token loss), dpo or simpo (preference pairs: records of prompt, chosen and "
        "rejected; docs/preference.md) (default {default})",
        commands=frozenset({*_TRAIN_DATA, "plan"}),  # the plan prices the head's extra pass and the reference pass
        choices=Objective,
        engine=EngineField("objective", _enum_value),
    )
    beta: float | None = option(
        None,
        help="dpo/simpo: the reward scale (default 0.1 for dpo, 2.0 for simpo)",
        rule=Rule("float", 0, low_open=True),
    )
    gamma: float = option(
        0.5,
        help="simpo: the target reward margin, subtracted after the beta scaling as TRL's simpo_gamma: "
        "loss = -logsigmoid(beta * (avg_chosen - avg_rejected) - gamma) (default {default})",
        rule=Rule("float", 0),
    )
    dpo_loss: DpoLoss = option(
        DpoLoss.SIGMOID,
        help="dpo: the loss on the reward margin, sigmoid (the DPO paper's) or ipo (default {default})",
        choices=DpoLoss,
    )
    label_smoothing: float = option(
        0.0,
        help="dpo sigmoid and simpo: the assumed fraction of flipped labels (conservative DPO, as TRL's "
        "label_smoothing), in [0, 0.5) (default 0)",
        rule=Rule("float", 0, 0.5, high_open=True),
    )
    ref_model: Path | None = option(
        None,
        help="dpo: the reference model's directory (default: the starting model, or --init-from's weights)",
        metavar="DIR",
    )
    batch_size: int = option(
        4,
        help="sequences per micro-batch (default {default})",
        commands=RUNS,
        defaults={"plan": 1, "bench": 16},
        rule=positive_int(),
        engine=AS_DECLARED,
    )
    grad_accum: int = option(
        1,
        help="micro-batches per optimizer step (default {default})",
        commands=_TRAIN_PLAN,
        rule=positive_int(),
        engine=AS_DECLARED,
    )
    steps: int | None = option(
        None,
        help="optimizer steps (default: --epochs over the data)",
        helps={"bench": "timed steps including warmup (default {default})"},
        commands=_TRAIN_BENCH,
        defaults={"bench": 6},
        rule=positive_int(),
    )
    epochs: int | None = option(
        None, help="passes over the data (default 1; 10 for the bundled demo text)", rule=positive_int(10**6)
    )
    lr: float | None = option(
        None, help="peak learning rate (default 1e-3 for presets, 2e-5 for checkpoints)", rule=Rule("float", 0)
    )
    weight_decay: float = option(0.0, help="AdamW weight decay on >= 2-dim params (default 0)", rule=Rule("float", 0))
    optimizer: str = option(
        "auto",
        help="host AdamW, one of {choices} (default auto: fused-adamw when numba runs here, else torch-adamw; "
        "torch and fused are short for torch-adamw and fused-adamw)",
        commands=RUNS,
        plugins="slide.optimizers",
        builtin=("auto",),
        aliases=OPTIMIZER_ALIASES,
        engine=AS_DECLARED,
    )
    optimizer_state: StateFormat = option(
        StateFormat.FP32,
        help="how AdamW keeps exp_avg and exp_avg_sq between steps: fp32 (exact, 8 B/param), bf16 (4 B/param) or "
        "int8 (~2 B/param), stochastically rounded (default {default})",
        commands=RUNS,
        choices=StateFormat,
        engine=AS_DECLARED,
    )
    master: MasterFormat = option(
        MasterFormat.AUTO, help=_MASTER_HELP, commands=RUNS, choices=MasterFormat, engine=AS_DECLARED
    )
    adam_beta1: float = option(0.9, help="default {default}", rule=Rule("float", 0, 1, high_open=True))
    adam_beta2: float = option(0.999, help="default {default}", rule=Rule("float", 0, 1, high_open=True))
    adam_eps: float = option(1e-8, help="default {default}", rule=Rule("float", FP32_TINY, 1))
    lr_schedule: LrSchedule = option(
        LrSchedule.LINEAR,
        help="default {default}; wsd: warmup, stable at --lr, then a decay over the last --decay-fraction of the steps",
        choices=LrSchedule,
    )
    warmup_steps: int = option(0, help="linear warmup steps (default 0)", rule=Rule("int", 0, INT_MAX))
    min_lr_ratio: float = option(
        0.0,
        help="lr floor after warmup, as a fraction of --lr, in [0, 1) (default 0)",
        rule=Rule("float", 0, 1, high_open=True),
    )
    decay_fraction: float = option(
        0.1,
        help="wsd: fraction of the steps that decay, in (0, 1] (default {default})",
        rule=Rule("float", 0, 1, low_open=True),
    )
    decay_shape: DecayShape = option(
        DecayShape.LINEAR, help="wsd: shape of the decay to the floor (default {default})", choices=DecayShape
    )
    warmup_ratio: float = option(
        0.0,
        help="linear warmup over this fraction of the optimizer steps, ceil(steps x ratio) as the HF Trainer, "
        "in [0, 1]; instead of --warmup-steps (default 0)",
        rule=Rule("float", 0, 1),
    )
    lr_cycles: int = option(
        1,
        help="cosine_with_restarts: cosine decays to the floor, each restarting at --lr (default {default})",
        rule=positive_int(10**6),
    )
    lr_power: float = option(
        1.0, help="polynomial: the decay's power, > 0 (default {default}: linear)", rule=Rule("float", 0, low_open=True)
    )
    lr_end: float = option(
        1e-7,
        help="polynomial: the lr at the last step and after, below --lr (default {default})",
        rule=Rule("float", 0),
    )
    lr_timescale: int | None = option(
        None,
        help="inverse_sqrt: lr = --lr / sqrt((step + timescale - warmup) / timescale) (default: the warmup steps, "
        "or 10000 without a warmup)",
        rule=positive_int(),
    )
    allow_data_change: bool = option(
        False,
        help="with --resume: train on data that changed since the checkpoint, from the saved position",
        action="store_true",
    )
    max_grad_norm: float = option(
        0.0,
        help="global gradient-norm clip, exact, 0 = off (default 0)",
        helps={
            "plan": "the gradient-norm clip slide train will use: with it on, the step's gradients are kept "
            "in a pinned store for the exact rollback, which the host peak counts (default 0 = off)"
        },
        commands=RUNS,
        rule=Rule("float", 0),
        engine=AS_DECLARED,
    )
    seed: int = option(0, help="seed for init and shuffling (default 0)", rule=Rule("int", 0, INT_MAX))
    no_shuffle: bool = option(False, help="keep file order", action="store_true")
    eval_data: Path | None = option(None, help="held-out data in any --data format, evaluated every --eval-every steps")
    eval_fraction: float = option(
        0.0,
        help="hold out this fraction of --data's examples instead",
        rule=Rule("float", 0, 1, high_open=True),
    )
    eval_every: int = option(
        0, help="evaluate every N steps (default 0: only at the end)", rule=Rule("int", 0, INT_MAX)
    )
    save_best: bool = option(
        False,
        help="keep the checkpoint with the lowest eval loss, and export it as <output>/model when the run ends "
        "(the last step's checkpoint stays in <output>/checkpoints)",
        helps={"plan": "slide train keeps the best checkpoint too, for the disk"},
        commands=_TRAIN_PLAN,
        action="store_true",
    )
    metrics: Path | None = option(None, help="JSON Lines metrics file (default <output>/metrics.jsonl)")
    report_to: tuple[str, ...] = option(
        (), help=f"also log to these trackers, comma-separated: {', '.join(REPORTERS)}; none for no tracker (default)"
    )
    run_name: str | None = option(
        None, help="the run's name in W&B and MLflow (default: the output directory's name)", metavar="NAME"
    )
    wandb_project: str | None = option(
        None, help="the W&B project (default: $WANDB_PROJECT, else slideformer)", metavar="NAME"
    )
    log_every: int = option(
        1,
        help="write a plain progress line every N steps when not on a terminal (default 1)",
        rule=positive_int(INT_MAX),
    )
    save_every: int = option(
        0, help="checkpoint every N steps (default 0: only at the end)", rule=Rule("int", 0, INT_MAX)
    )
    keep_checkpoints: int = option(
        2,
        help="how many resumable checkpoints to keep, the newest; with --save-best the best one is kept in "
        "addition when it is older; 0: the run ends with the exported model alone, written from the training "
        "state, for a disk that holds the export but not a checkpoint (a stop still writes one to resume "
        "from) (default {default})",
        helps={"plan": "checkpoints slide train keeps, for the disk; 0: the export alone (default {default})"},
        commands=_TRAIN_PLAN,
        rule=Rule("int", 0, 10**6),
    )
    save_weights_every: int = option(
        0,
        help="also export the weights alone every N steps, an HF model directory in --save-dtype without "
        "optimizer state, to <output>/weights/step-NNNNNNNN; all are kept (default 0: never)",
        helps={"plan": "slide train's weights-only saves, for the disk (default 0: none)"},
        commands=_TRAIN_PLAN,
        rule=Rule("int", 0, INT_MAX),
    )
    save_delete_first: bool = option(
        False,
        help="delete the oldest checkpoint before writing the next, for a disk that cannot hold one more; a "
        "failure during that write leaves one checkpoint fewer (none with --keep-checkpoints 1)",
        helps={"plan": "slide train deletes before it saves, for the disk"},
        commands=_TRAIN_PLAN,
        action="store_true",
    )
    save_async: bool = option(
        False,
        help="write --save-every and --save-best checkpoints in the background while training goes on, from "
        "a copy taken between steps (host RAM: one checkpoint's size, held from the first save on)",
        helps={"plan": "slide train writes checkpoints in the background: price the copy's pause and host RAM"},
        commands=_TRAIN_PLAN,
        action="store_true",
    )
    push_to_hub: str | None = option(
        None,
        help="upload the exported model to this Hub repository (org/name) when the run ends; checked before "
        "training (HF_HUB_OFFLINE, the repository); a failed push keeps the run and names the command that retries",
        metavar="REPO",
    )
    hub_private: bool = option(False, help="with --push-to-hub: create the repository private", action="store_true")
    resume: Path | None = option(
        None,
        help="continue a run: its output directory or one of its checkpoints; the run's options come back with "
        "it, and only steps, saving, evaluation, logging and placement may change",
    )
    init_from: Path | None = option(
        None,
        help="start a new run from a run's newest checkpoint (or the checkpoint named): its weights and AdamW "
        "state (moments and step count), under this run's own lr, schedule, steps and data (default model: "
        "that run's)",
        metavar="RUN|CHECKPOINT",
    )
    init_weights_only: bool = option(
        False, help="with --init-from: take the weights alone; AdamW starts afresh", action="store_true"
    )
    gpu_memory: str | int | float | None = option(
        None,
        help="hard GPU memory cap, e.g. 24 (GiB), 24GiB or 80GB",
        helps={
            "plan": "GPU memory budget (default: the visible GPU's)",
            "bench": "GPU cap for the engine, e.g. 24 (GiB), 24GiB or 80GB (default: the whole card)",
        },
        commands=RUNS,
        metavar="SIZE",
        engine=EngineField("gpu_memory_bytes", _size_bytes),
    )
    offload_optimizer: str = option(
        "ram",
        help="the tier for the Adam state of --nvme-fraction of the units, one of {choices} (default ram); ram "
        "keeps it in host RAM beside the master, nothing offloaded",
        commands=RUNS,
        plugins="slide.tiers",
        builtin=("ram",),
        engine=AS_DECLARED,
    )
    nvme_dir: Path | None = option(
        None, help="directory on NVMe for offloaded state", commands=_TRAIN_BENCH, engine=AS_DECLARED
    )
    nvme_fraction: float = option(
        1.0,
        help="fraction of units whose state goes to the --offload-optimizer tier (default {default})",
        commands=RUNS,
        rule=Rule("float", 0, 1),
        engine=AS_DECLARED,
    )
    offload_activations: str = option(
        "ram",
        help="the tier for the boundary activations, one of {choices}; a tier in memory keeps them in the "
        "engine's pinned host stash (default ram)",
        commands=_TRAIN_PLAN,
        plugins="slide.tiers",
        builtin=("ram",),
        engine=AS_DECLARED,
    )
    save_dtype: SaveDType = option(
        SaveDType.AUTO,
        help="dtype of the exported model (default {default}: the model's)",
        commands=_TRAIN_PLAN,
        choices=SaveDType,
        aliases=DTYPE_ALIASES,
    )
    block_slots: int = option(
        2,
        help="GPU slots for decoder blocks (default {default})",
        commands=RUNS,
        rule=Rule("int", 1, 64),
        engine=AS_DECLARED,
    )
    seq_tile: int | str | None = option(
        None,
        help="tokens per tile of the blocks' MLPs and norms: a micro-batch of more tokens runs them tile by tile, "
        "in the forward and in the backward's recompute, so only one tile's intermediates are held; 0 turns it "
        "off; auto (default): untiled where the GPU budget holds that, else the largest tile that fits "
        f"(without a GPU budget, {DEFAULT_SEQ_TILE} where --seq-len exceeds it)",
        commands=RUNS,
        rule=Rule("int", 0, 2**24),
        metavar="TOKENS|auto",
        engine=AS_DECLARED,
    )
    update_placement: UpdatePlacement = option(
        UpdatePlacement.HOST,
        help="where the AdamW update of units not resident on the GPU runs: host (default), gpu (master and "
        "moments stream to the GPU with the unit; with --max-grad-norm the host corrects a step that clips) or "
        "auto (per unit, from this machine's rates that `slide doctor` measures; host on the CPU device)",
        commands=RUNS,
        choices=UpdatePlacement,
        engine=EngineField("update_placement", _enum_value),
    )

    def __post_init__(self) -> None:
        _normalise_data(self)
        _normalise_seq_tile(self)
        for name in sorted(_PATH_FIELDS):
            value = getattr(self, name)
            if isinstance(value, str):
                if not value.strip():
                    raise UserError(f"{spelled(name)} must not be empty")
                object.__setattr__(self, name, Path(value))
        for item in train_options():
            value = item.normalised(getattr(self, item.name))
            object.__setattr__(self, item.name, value)
            check_option(item.name, value)
        _normalise_reporting(self)
        from slide_hf.sizes import parse_size

        for name in ("gpu_memory", "max_record_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or (value is not None and not isinstance(value, str | int | float)):
                raise UserError(f"{spelled(name)} must be a size such as 24GiB, got {value!r}")
            if value is not None:  # a plain number (a TOML 24) is GiB, as on the command line
                object.__setattr__(self, name, str(value))
                parse_size(str(value), what=spelled(name))
        self.validate(1, _COMMAND.get())

    @classmethod
    def for_command(cls, command: Command, world_size: int = 1, **values: Any) -> TrainConfig:
        """The options ``command`` (`slide plan`, `slide bench`, `slide data`) shares with `slide train`, checked by the
        same rules, for a run of ``world_size`` processes; the cross-option rules over options ``command``
        does not take (`slide plan`'s ``--save-best`` needs no evaluation data: it only sizes the disk) do
        not apply."""
        token = _COMMAND.set(command)
        try:
            cfg = cls(**values)
        finally:
            _COMMAND.reset(token)
        cfg.validate(world_size, command)
        return cfg

    def validate(self, world_size: int = 1, command: Command = "train") -> None:
        """Apply every cross-option rule (slide_hf/options/validate.py) for a run of ``world_size``
        processes, as ``command`` takes the options. Construction applies them for one process; `slide
        train` calls it again with the real number of processes, `slide plan` with the planned one."""
        from slide_hf.options.validate import validate

        validate(self, world_size, command)

    @property
    def evaluates(self) -> bool:
        return self.eval_data is not None or self.eval_fraction > 0

    @property
    def preference(self) -> bool:
        """Whether the run trains on preference pairs (dpo, simpo) rather than next-token loss."""
        return self.objective != Objective.SFT

    @property
    def resolved_beta(self) -> float:
        """``--beta``, or the objective's default: 0.1 for DPO (TRL's), 2.0 for SimPO (the SimPO paper's)."""
        if self.beta is not None:
            return self.beta
        return 2.0 if self.objective == Objective.SIMPO else 0.1

    @property
    def max_record_bytes(self) -> int:
        """``--max-record-size`` in bytes (default 8 MiB, docs/data.md)."""
        from slide_hf.data.readers import DEFAULT_MAX_RECORD_BYTES
        from slide_hf.sizes import parse_size

        if self.max_record_size is None:
            return DEFAULT_MAX_RECORD_BYTES
        return parse_size(str(self.max_record_size), what=spelled("max_record_size"))


@dataclass(frozen=True)
class Launch:
    """Options that say how many processes run, not what one of them does: not part of a run's saved
    options, nor a ``slide_hf.train`` keyword (a notebook is one process)."""

    nproc_per_node: int | None = option(
        None,
        help="data parallel on this host: run N processes, one per GPU, as torchrun would (docs/distributed.md)",
        helps={"plan": "data parallel: ranks (GPUs) per host (default {default})"},
        commands=frozenset({"train", "plan"}),
        defaults={"plan": 1},
        metavar="N",
    )


def train_options() -> tuple[Declared, ...]:
    """The options of :class:`TrainConfig`: the TOML keys and the ``slide_hf.train`` keywords."""
    return _TRAIN_OPTIONS


_TRAIN_OPTIONS = declared(TrainConfig)
_BY_NAME = {item.name: item for item in _TRAIN_OPTIONS}
RULES: dict[str, Rule] = {item.name: rule for item in _TRAIN_OPTIONS if (rule := item.spec.value_rule()) is not None}
"""Option name (underscored, as in TOML and the Python API) -> what one value accepts. ``None`` always
passes where the field allows it (``steps``, ``epochs``, ``lr``: "choose for me")."""
_PATH_FIELDS = frozenset(
    {"tokenizer", "output", "eval_data", "metrics", "resume", "init_from", "nvme_dir", "ref_model"}
)


def installed_names(name: str) -> str:
    """``"auto, cpu, cuda, rocm"``: what the plugin-backed option ``name`` accepts here, for help texts."""
    try:
        return ", ".join(RULES[name].names())
    except Exception:  # unreadable metadata must not break every command's parser
        return "see `slide doctor`"


def check_option(name: str, value: Any, *, flag: str | None = None) -> None:
    """Refuse ``value`` for option ``name`` in one line, unless its rule accepts it (an alias is resolved
    first). ``flag`` is how the caller's user wrote the option; the default is :func:`spelled`'s."""
    rule = RULES.get(name)
    if rule is None:
        return
    item = _BY_NAME.get(name)
    value = item.normalised(value) if item is not None else value
    if value is None or rule.accepts(value):
        return
    shown = flag or spelled(name)
    raise UserError(f"{shown} must be {rule.describe()}, got {value!r}{rule.out_of_range_word(value)}")


def _normalise_seq_tile(cfg: TrainConfig) -> None:
    """``seq_tile``: ``auto`` (a flag's text or a TOML string) is None, the planner's choice; a flag's digits
    are the integer its rule then checks; any other text is refused here, naming what is accepted."""
    value = cfg.seq_tile
    if not isinstance(value, str):
        return
    text = value.strip().lower()
    if text == "auto":
        object.__setattr__(cfg, "seq_tile", None)
    elif text.lstrip("+-").isdigit():
        object.__setattr__(cfg, "seq_tile", int(text))
    else:
        raise UserError(f"{spelled('seq_tile')} must be auto or an integer in [0, {2**24}], got {value!r}")


def _normalise_data(cfg: TrainConfig) -> None:
    """``data``: one source as a Path, several (a mixture) as a tuple of Paths; ``data_weights``: a tuple
    of positive finite numbers, one per source (``"3,1"`` from the command line, a list from TOML)."""
    data: Any = cfg.data
    items = list(data) if isinstance(data, list | tuple) else ([] if data is None else [data])
    for item in items:
        if not isinstance(item, str | Path) or not str(item).strip():
            raise UserError(f"{spelled('data')} must name a file, a datasets directory or a Hub dataset, got {item!r}")
    if isinstance(data, list | tuple) and not items:
        raise UserError(f"{spelled('data')} must name at least one source")
    paths = tuple(Path(item) for item in items)
    object.__setattr__(cfg, "data", None if not paths else paths[0] if len(paths) == 1 else paths)
    weights: Any = cfg.data_weights
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
            raise UserError(
                f"{spelled('data_weights')} must be positive finite numbers, one per {spelled('data')}, got {weight!r}"
            )
        parsed.append(value)
    if len(parsed) != len(paths):
        raise UserError(
            f"{spelled('data_weights')} gives {len(parsed)} weight(s) for {len(paths)} {spelled('data')} source(s)"
        )
    object.__setattr__(cfg, "data_weights", tuple(parsed))


def _split_reporters(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _normalise_reporting(cfg: TrainConfig) -> None:
    """``report_to``: a tuple of tracker names (``"wandb,mlflow"`` from the command line, a list from TOML or
    Python); ``none`` alone is no tracker, as the HF Trainer spells it. A run name, a W&B project and a Hub
    repository must be non-empty text, and the repository an ``org/name`` id."""
    value: Any = cfg.report_to
    if not isinstance(value, str | list | tuple) or not all(isinstance(name, str) for name in value):
        raise UserError(f"{spelled('report_to')} must be tracker names ({', '.join(REPORTERS)} or none), got {value!r}")
    names = _split_reporters(value) if isinstance(value, str) else tuple(name.strip() for name in value)
    if "none" in names:
        if len(names) > 1:
            raise UserError(f"{spelled('report_to', ','.join(names))}: none means no tracker; give it alone")
        names = ()
    object.__setattr__(cfg, "report_to", names)
    unknown = [name for name in names if name not in REPORTERS]
    if unknown:
        raise UserError(f"{spelled('report_to')} must name {', '.join(REPORTERS)}; got {', '.join(map(repr, unknown))}")
    for name in ("run_name", "wandb_project", "push_to_hub"):
        text = getattr(cfg, name)
        if text is not None and (not isinstance(text, str) or not text.strip()):
            raise UserError(f"{spelled(name)} must be non-empty text, got {text!r}")
    if cfg.push_to_hub is not None:
        from slide_hf.hub import check_repo_id

        check_repo_id(cfg.push_to_hub, flag=spelled("push_to_hub"))


def default_lr(from_preset: bool) -> float:
    """The peak lr when none is given: 1e-3 for a preset's random init, 2e-5 to fine-tune real weights.
    The recipe resolves it once and saves the number, so a resume compares numbers, never ``None``."""
    return 1e-3 if from_preset else 2e-5
