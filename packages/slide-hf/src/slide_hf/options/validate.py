"""Every rule that relates several options, in one table, applied by :func:`validate`.

`slide train` (before it launches processes, and in every rank), `slide plan`, `slide bench` and
``slide_hf.train`` all call :func:`validate` (through :meth:`TrainConfig.validate`), so a combination is
refused with the same line whichever way it came in. A rule applies to a command only when the command
takes every option the rule reads: `slide plan` has no ``--nvme-dir`` (it plans the disk, it writes none),
so the rule that a disk tier needs a directory is `slide train`'s and `slide bench`'s alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slide_hf.defaults import check_seq_tile
from slide_hf.errors import UserError
from slide_hf.options.companions import COMPANIONS
from slide_hf.options.schema import Command, taken_by
from slide_hf.spelling import option

if TYPE_CHECKING:
    from slide_hf.options.config import TrainConfig

__all__ = ["CROSS_RULES", "CrossRule", "check_adamw", "validate"]


@dataclass(frozen=True)
class CrossRule:
    """A rule over ``options`` (their names), which raises one :class:`UserError` line naming them."""

    options: tuple[str, ...]
    check: Callable[[TrainConfig, int], None]


def check_adamw(lr: float | None, weight_decay: float, *, default_lr: float | None = None) -> None:
    """Refuse a weight decay that flips the weights' sign: AdamW scales each weight by ``1 - lr * wd`` per
    step, so ``lr * wd`` must stay below 1 (past it every step negates and grows the weights, and the run
    fails steps later with a message about the loss). ``default_lr`` is the lr used when ``lr`` is None."""
    rate = lr if lr is not None else default_lr
    if rate is None or weight_decay == 0 or rate * weight_decay < 1:
        return
    shown = f"{option('lr')} {rate:g}" if lr is not None else f"the default {option('lr')} {rate:g}"
    raise UserError(
        f"{option('weight_decay')} {weight_decay:g} with {shown} scales every weight by 1 - lr * wd = "
        f"{1 - rate * weight_decay:g} per step; lr * wd must be below 1 (a weight decay is usually 0.0-0.1)"
    )


def _weight_decay(cfg: TrainConfig, world_size: int) -> None:
    check_adamw(cfg.lr, cfg.weight_decay)


def _one_eval_source(cfg: TrainConfig, world_size: int) -> None:
    if cfg.eval_data is not None and cfg.eval_fraction > 0:
        raise UserError(
            f"{option('eval_data')} and {option('eval_fraction')} both choose the evaluation data; give one"
        )


def _best_needs_eval(cfg: TrainConfig, world_size: int) -> None:
    if cfg.save_best and not cfg.evaluates:
        raise UserError(
            f"{option('save_best')} needs evaluation data: {option('eval_data', 'FILE')} or "
            f"{option('eval_fraction', 'F')}"
        )


def _init_from_is_a_new_run(cfg: TrainConfig, world_size: int) -> None:
    if cfg.init_from is not None and cfg.resume is not None:
        raise UserError(
            f"{option('init_from')} starts a new run from a checkpoint's weights and AdamW state, and "
            f"{option('resume')} continues a run in its own directory; give one"
        )


def _floor_needs_a_decay(cfg: TrainConfig, world_size: int) -> None:
    from slide_core.schedule import FLOORED

    if cfg.min_lr_ratio > 0 and cfg.lr_schedule not in FLOORED:
        ends = f"; polynomial ends at {option('lr_end')}" if cfg.lr_schedule == "polynomial" else ""
        raise UserError(
            f"{option('min_lr_ratio')} is the floor of a decay to an end; {option('lr_schedule', cfg.lr_schedule.value)} "
            f"has none (use linear, cosine, wsd or cosine_with_restarts{ends})"
        )


def _one_warmup(cfg: TrainConfig, world_size: int) -> None:
    if cfg.warmup_ratio > 0 and cfg.warmup_steps > 0:
        raise UserError(
            f"{option('warmup_steps', cfg.warmup_steps)} and {option('warmup_ratio', f'{cfg.warmup_ratio:g}')} both "
            "set the warmup; give one"
        )


def _end_below_peak(cfg: TrainConfig, world_size: int) -> None:
    if cfg.lr_schedule == "polynomial" and cfg.lr is not None and not cfg.lr_end < cfg.lr:
        raise UserError(
            f"{option('lr_end', f'{cfg.lr_end:g}')} must be below {option('lr', f'{cfg.lr:g}')}: polynomial "
            "decays from --lr down to it"
        )


def _split_master_needs_bf16(cfg: TrainConfig, world_size: int) -> None:
    if cfg.master == "split" and cfg.dtype is not None and cfg.dtype != "bfloat16":  # unset: split takes bf16
        raise UserError(
            f"{option('master', 'split')} stores the bf16 copy the GPU computes with, so it needs "
            f"{option('dtype', 'bfloat16')}, got {cfg.dtype.value}; use {option('master', 'fp32')} or auto"
        )


def _tile_below_a_micro_batch(cfg: TrainConfig, world_size: int) -> None:
    """A given ``--seq-len``: checked here, before anything runs; else once the model resolves it
    (``RunOptions.from_config``, by the same rule)."""
    if cfg.seq_len is not None:
        check_seq_tile(cfg.seq_tile if isinstance(cfg.seq_tile, int) else None, cfg.batch_size, cfg.seq_len)


def _int8_state_is_one_process(cfg: TrainConfig, world_size: int) -> None:
    """A rank's shard of a unit could split one of int8's 64-element blocks, whose scale is shared."""
    if world_size > 1 and cfg.optimizer_state == "int8":
        raise UserError(
            f"{option('optimizer_state', 'int8')} does not run with data parallel ({world_size} processes) yet: a "
            f"rank's shard could split one of its 64-element blocks; use {option('optimizer_state', 'bf16')} or fp32"
        )


def _one_process_saving(name: str, why: str) -> Callable[[TrainConfig, int], None]:
    """A way of saving that one process does alone (docs/checkpoints.md): refused with data parallel."""

    def check(cfg: TrainConfig, world_size: int) -> None:
        if world_size > 1 and getattr(cfg, name):
            raise UserError(f"{option(name)} does not run with data parallel ({world_size} processes) yet: {why}")

    return check


def _export_only_is_one_process(cfg: TrainConfig, world_size: int) -> None:
    if cfg.keep_checkpoints == 0 and world_size > 1:
        raise UserError(
            f"{option('keep_checkpoints', 0)} does not run with data parallel ({world_size} processes) yet: the "
            "export from the training state is one process's"
        )


def _export_only_without(name: str, what: str) -> CrossRule:
    """``--keep-checkpoints 0`` ends the run with the export alone, written from the training state
    (docs/checkpoints.md "Export only"): an option that writes or keeps checkpoints has nothing to act on."""

    def check(cfg: TrainConfig, world_size: int) -> None:
        if cfg.keep_checkpoints == 0 and getattr(cfg, name):
            raise UserError(f"{option(name)} {what}, and {option('keep_checkpoints', 0)} keeps none; give one")

    return CrossRule(("keep_checkpoints", name), check)


def _disk_tier_needs_a_directory(name: str) -> Callable[[TrainConfig, int], None]:
    """A tier that keeps files (``nvme``, ``gds``) needs ``--nvme-dir``: refused before anything is built."""

    def check(cfg: TrainConfig, world_size: int) -> None:
        from slide_hf.offload import planning_kind, tier_class

        chosen = getattr(cfg, name)
        if cfg.nvme_dir is None and planning_kind(tier_class(chosen, flag=option(name))) == "nvme":
            raise UserError(
                f"{option(name, chosen)} needs {option('nvme_dir', 'PATH')} (a directory on a fast local disk)"
            )

    return check


def _preference_option(name: str, objectives: tuple[str, ...], changed: Callable[[TrainConfig], bool]) -> CrossRule:
    """An option of the preference losses (``--beta``, ``--gamma``, ...) acts only under ``objectives``:
    given under another objective it would change nothing, silently, so it is refused in one line."""

    def check(cfg: TrainConfig, world_size: int) -> None:
        if changed(cfg) and cfg.objective.value not in objectives:
            needed = " or ".join(option("objective", name) for name in objectives)
            raise UserError(f"{option(name)} acts only with {needed}, got {option('objective', cfg.objective.value)}")

    return CrossRule((name, "objective"), check)


def _smoothing_is_not_ipo(cfg: TrainConfig, world_size: int) -> None:
    if cfg.label_smoothing > 0 and cfg.objective == "dpo" and cfg.dpo_loss == "ipo":
        raise UserError(
            f"{option('label_smoothing')} smooths the sigmoid loss; {option('dpo_loss', 'ipo')} has none "
            "(as in TRL); drop one"
        )


def _preference_without(name: str, why: str) -> CrossRule:
    """An option the preference objectives do not take yet: refused in one line rather than ignored."""

    def check(cfg: TrainConfig, world_size: int) -> None:
        value = getattr(cfg, name)
        if cfg.preference and value not in (None, False, 0, 0.0, ()):
            raise UserError(f"{option(name)} does not run with {option('objective', cfg.objective.value)} yet: {why}")

    return CrossRule((name, "objective"), check)


CROSS_RULES: tuple[CrossRule, ...] = (
    CrossRule(("lr", "weight_decay"), _weight_decay),
    CrossRule(("eval_data", "eval_fraction"), _one_eval_source),
    CrossRule(("save_best", "eval_data", "eval_fraction"), _best_needs_eval),
    CrossRule(("init_from", "resume"), _init_from_is_a_new_run),
    CrossRule(("min_lr_ratio", "lr_schedule"), _floor_needs_a_decay),
    CrossRule(("warmup_steps", "warmup_ratio"), _one_warmup),
    CrossRule(("lr_end", "lr", "lr_schedule"), _end_below_peak),
    # Options that act only beside another (--decay-fraction beside --lr-schedule wsd): options/companions.py
    *(CrossRule(companion.options, companion.rule) for companion in COMPANIONS),
    CrossRule(("master", "dtype"), _split_master_needs_bf16),
    CrossRule(("seq_tile", "batch_size", "seq_len"), _tile_below_a_micro_batch),
    CrossRule(("optimizer_state",), _int8_state_is_one_process),
    CrossRule(("offload_optimizer", "nvme_dir"), _disk_tier_needs_a_directory("offload_optimizer")),
    CrossRule(("offload_activations", "nvme_dir"), _disk_tier_needs_a_directory("offload_activations")),
    CrossRule(
        ("save_weights_every",),
        _one_process_saving("save_weights_every", "each rank holds only its shards of the weights"),
    ),
    CrossRule(
        ("save_async",),
        _one_process_saving("save_async", "the ranks publish a checkpoint together, between steps"),
    ),
    CrossRule(("keep_checkpoints",), _export_only_is_one_process),
    _export_only_without("save_every", "writes checkpoints mid-run"),
    _export_only_without("save_best", "keeps the best checkpoint"),
    _export_only_without("save_delete_first", "makes room for the next checkpoint"),
    _export_only_without("save_async", "writes checkpoints in the background"),
    # The preference objectives (docs/preference.md).
    _preference_option("beta", ("dpo", "simpo"), lambda cfg: cfg.beta is not None),
    _preference_option("gamma", ("simpo",), lambda cfg: cfg.gamma != 0.5),
    _preference_option("dpo_loss", ("dpo",), lambda cfg: cfg.dpo_loss != "sigmoid"),
    _preference_option("label_smoothing", ("dpo", "simpo"), lambda cfg: cfg.label_smoothing > 0),
    _preference_option("ref_model", ("dpo",), lambda cfg: cfg.ref_model is not None),
    CrossRule(("label_smoothing", "dpo_loss", "objective"), _smoothing_is_not_ipo),
    _preference_without("train_on_inputs", "the loss is on each pair's completions alone"),
)
"""Every cross-option rule, in the order they are checked (the first that fails is the one line)."""


def validate(cfg: TrainConfig, world_size: int = 1, command: Command = "train") -> None:
    """Refuse, in one line, a combination of ``cfg``'s options that a run of ``world_size`` processes
    cannot do; only the rules over options ``command`` takes apply."""
    taken = taken_by(type(cfg), command)
    for rule in CROSS_RULES:
        if taken.issuperset(rule.options):
            rule.check(cfg, world_size)
