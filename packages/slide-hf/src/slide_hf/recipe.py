"""The training recipe behind `slide train`: setup in dependency order, then one loop.

Read :func:`_train` top to bottom. Each ``_setup_*`` step takes what the steps before it made:

1. ``_setup_model``: the config, the tokenizer and the units (a model directory, a Hub name or a preset);
2. ``_setup_device``: the ``--device`` plugin, capped at ``--gpu-memory``, and the compute dtype left unset
   (``_setup_compute_dtype``: the device's);
3. ``_setup_data``: the rows (cached in the run directory), the batches, the step count and the LR schedule;
4. ``_setup_optimizer``: the ``--optimizer`` plugin, its kernels compiled before anything is allocated;
5. ``_setup_placement``: refuse what cannot fit, then choose what lives on the GPU and on the
   ``--offload-optimizer`` tier (slide_hf/setup.py, shared with `slide bench`);
6. ``_setup_run_log``: metrics and trackers;
7. ``_setup_weights``: the fp32 master (stored as ``--master`` says), from HF weights or a random init,
   or from a checkpoint (``--init-from``, slide_hf/init_from.py, whose AdamW state the loop then restores);
8. ``_setup_engine``: the tiers and the engine (slide_hf/setup.py).

Then :class:`_Trainer` runs the loop over optimizer steps -- LR, forward/backward with accumulation, clip
and step (one engine call), logging, evaluation, checkpoint, termination -- and the final checkpoint and
the HF export.

Launched by torchrun with several processes (``WORLD_SIZE`` > 1) the same recipe runs data parallel
(docs/distributed.md): every rank trains on its rows of each step's global batch, rank 0 alone owns the
run directory (the lock, options.json, train.log, metrics, trackers, progress and the export), and each
rank writes its shard file into the step's checkpoint (slide_core/checkpoint). One process is a world of
one (slide_core/collectives.py): the same recipe, whose collectives then do nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from slide_core import AdamWConfig, HostParameters, LRSchedule, Optimizer
from slide_core.checkpoint import (
    BackgroundSaver,
    CheckpointCorrupt,
    CheckpointWriteError,
    checkpoint_nbytes,
    format_size,
    prune,
    save_checkpoint,
)
from slide_core.collectives import SingleProcess
from slide_core.device import Device
from slide_core.distributed import ProcessGroupContext
from slide_core.engine import Engine, EngineError
from slide_core.engine.shards import UnitShards
from slide_core.master_store import MasterFormat
from slide_core.optim.state_formats import StateFormatMismatch
from slide_core.schedule import warmup_from_ratio
from slide_hf.data import Batches, DataOptions, DataPosition, eval_batches, load_dataset, load_split
from slide_hf.defaults import DEMO_EPOCHS, model_positions, resolve_seq_len
from slide_hf.errors import Interrupted, RunStopped, UserError
from slide_hf.export import use_tokenizer_special_tokens
from slide_hf.in_step_rates import InStepMeter, checkpoint_write_gbps, learn_checkpoint_write, learn_rates
from slide_hf.init_from import InitPoint, init_point, init_record, load_initial_master, restore_adam_state
from slide_hf.launch import failure_outlives_peers, host_cores_for_this_run, stop_with_launcher
from slide_hf.model_checkpoint import load_best_for_export, read_best
from slide_hf.options import DType, TrainConfig, check_adamw, config_dict, data_sources, default_lr
from slide_hf.plan_check import PlanCheck
from slide_hf.planner import Plan
from slide_hf.planner import output_disk as disk
from slide_hf.planner.fit import available_host_bytes
from slide_hf.planner.save_cost import SaveCost, save_cost
from slide_hf.preference.head import metric_means
from slide_hf.preference.reference import PassStopped
from slide_hf.preference.run import (
    PreferenceObjective,
    attach_objective,
    check_ref_model,
    eval_metrics,
    evaluation_scope,
    load_preference_data,
    needs_reference_pass,
    run_reference,
    step_metric_sums,
)
from slide_hf.progress import Progress
from slide_hf.replacement import Replacement, compact_units
from slide_hf.resume import (
    check_same_data,
    checkpoint_to_resume,
    corrupt_message,
    resume_point,
    resumed_schedule,
    run_data_digests,
)
from slide_hf.run_dir import RunDir, default_output, inputs_of, run_of
from slide_hf.run_export import export_run_model, export_weights, set_aside_weights, streamed_master
from slide_hf.run_log import RunLog
from slide_hf.setup import (
    EngineParts,
    Placement,
    RunOptions,
    flops_per_token,
    make_device,
    make_optimizer,
    open_engine,
    place_units,
)
from slide_hf.spelling import option, train_call
from slide_hf.tokenizer import load_tokenizer

__all__ = ["TrainConfig", "TrainSummary", "config_dict", "train"]

log = logging.getLogger("slide.train")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class TrainSummary:
    steps: int
    first_loss: float
    last_loss: float
    output: Path
    model_dir: Path
    losses: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class _Model:
    """What ``_setup_model`` resolves: the HF config, the weights' directory (None for a preset), the
    tokenizer and the units."""

    config: Any
    model_dir: Path | None
    tokenizer: Any
    slide_model: Any  # the adapter's SlideModel: the units the engine slides


@dataclass(frozen=True)
class _Data:
    """What ``_setup_data`` prepares: training rows and batches, held-out rows, how long and how fast."""

    dataset: Any
    eval_set: Any
    batches: Batches
    total_steps: int
    schedule: LRSchedule


def train(
    cfg: TrainConfig,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
) -> TrainSummary:
    """Run a whole training job; see the module docstring for the order of things. ``on_step`` and
    ``on_eval`` receive each metrics record as it is written (the Python API's callbacks).

    The output directory is this run's alone while it runs (slide_hf/run_dir.py): locked, refused when it
    holds another run unless resuming or ``overwrite``, and a resumed run defaults to its own directory."""
    stop_with_launcher()  # a launched rank stops when its launcher is gone (Note [A rank outlives no launcher])
    group = _process_group(cfg)
    cfg.validate(group.world_size)  # the options' rules for this many processes (slide_hf/options/validate.py)
    _check_reporting(cfg, group)  # trackers and the Hub: refused before any data is read
    on_host = os.environ.get("LOCAL_WORLD_SIZE", "")
    ranks_on_host = int(on_host) if on_host.isdigit() and int(on_host) > 0 else group.world_size
    output = cfg.output or (run_of(cfg.resume) if cfg.resume is not None else default_output())
    # Before numba is imported: Note [Host cores per rank] in launch.py.
    # Inside the group: a failure here ignores the launcher's SIGTERM before the group's connections close.
    with host_cores_for_this_run(ranks_on_host), group, failure_outlives_peers():
        log.info("host threads per rank: %s (%d ranks on this host)", os.environ["NUMBA_NUM_THREADS"], ranks_on_host)
        # Rank 0 holds the directory; the others write only their checkpoint shards in it, and only remove
        # their NVMe scratch folders at the end (closing an unlocked RunDir).
        run_dir = RunDir(output, resume_from=cfg.resume, overwrite=cfg.overwrite, inputs=inputs_of(cfg))
        with run_dir if group.rank == 0 else contextlib.closing(run_dir):
            group.barrier("the wait for rank 0 to claim the output directory")
            return _train(cfg, run_dir, on_step=on_step, on_eval=on_eval, group=group)


def _train(
    cfg: TrainConfig,
    run_dir: RunDir,
    *,
    on_step: Callable[[dict[str, Any]], None] | None,
    on_eval: Callable[[dict[str, Any]], None] | None,
    group: RunGroup,
) -> TrainSummary:
    """``group``: this rank's place in the run (open): a data-parallel rank, or a world of one."""
    main = group.rank == 0  # the rank that owns the run directory
    torch.manual_seed(cfg.seed)
    model = _setup_model(cfg)
    from slide_hf.adapters.base import refuse_packing

    refuse_packing(model.slide_model, packing=cfg.packing)  # before the data is read and tokenized
    check_ref_model(cfg.ref_model, model.config)  # before anything is read or run with it
    if cfg.lr is None:  # resolved once and saved as a number, so a resume compares numbers
        resolved = default_lr(from_preset=model.model_dir is None)
        check_adamw(None, cfg.weight_decay, default_lr=resolved)  # the message says the lr was the default
        cfg = dataclasses.replace(cfg, lr=resolved)
    # The default row length depends on the model (its context length) and the data (the demo's own).
    cfg = dataclasses.replace(cfg, seq_len=resolve_seq_len(cfg.seq_len, model.config, bundled_text=cfg.data is None))
    options = RunOptions.from_config(cfg)  # the options the engine reads (slide_hf/options/engine.py)
    device = _setup_device(options, group)
    if cfg.dtype is None:  # the device's, chosen once and saved as chosen (a resume keeps it)
        cfg = dataclasses.replace(cfg, dtype=_setup_compute_dtype(cfg, device, group))
        options = RunOptions.from_config(cfg)
    # Resume: the checkpoint's run state (state.json only) before the data, whose schedule it continues.
    resumed = checkpoint_to_resume(cfg.resume) if cfg.resume is not None else None
    init = None  # --init-from: a new run from a checkpoint's weights and AdamW state (slide_hf/init_from.py)
    if cfg.init_from is not None:
        only = cfg.init_weights_only
        init = init_point(cfg.init_from, model.slide_model, weights_only=only, state_format=cfg.optimizer_state.value)
    data = _setup_data_once(cfg, model, run_dir.path, group, resumed)
    # None for SFT (docs/preference.md); a head for the training pairs, and one for the held-out pairs
    preference = attach_objective(cfg, model.slide_model, data.dataset, data.eval_set)
    optimizer = _setup_optimizer(cfg, options)
    outputs = _output_disk(cfg, model, optimizer, data.total_steps)
    if main:
        disk.check_output_disk(run_dir.path, outputs)
    placement = _setup_placement(model, device, options, group, optimizer)
    saving = _plan_saves(cfg, outputs, placement.plan, run_dir.path) if main else None
    run_log = _setup_run_log(cfg, run_dir.path) if main else None
    with device, run_log or contextlib.nullcontext():
        host = _setup_weights(cfg, model, placement.plan.inputs.master_format, group, init)
        # Each rank reads at its own pace (Note [Waits on one rank's work]).
        group.barrier("the wait for every rank to load the weights", slow=True)
        flops = _log_run(cfg, model, data, device, optimizer, group)
        tokenizer_dir = run_dir.path / "tokenizer"
        if main:
            tokenizer_dir = _save_tokenizer(model.tokenizer, model.config, run_dir.path, model.model_dir)
            run_dir.record_outputs()  # what --overwrite may remove later (slide_hf/run_files.py)
        cache = run_dir.path / DATA_CACHE
        stop = _StopRequests(others=group.world_size - 1)
        if cfg.ref_model is not None and needs_reference_pass(
            cfg, preference, cache, model.model_dir, group, resumed=resumed is not None
        ):
            # DPO's reference pass on --ref-model: its own weights and engine, closed before training starts
            assert preference is not None  # needs_reference_pass says so
            reference = _setup_weights(
                cfg, dataclasses.replace(model, model_dir=cfg.ref_model), placement.plan.inputs.master_format, group
            )
            ref_parts = _setup_engine(model, device, reference, optimizer, options, placement, run_dir, group)
            with stop, _stops_the_pass(stop, group, run_dir.path), ref_parts as ref_engine:
                run_reference(
                    cfg, preference, cache, model.model_dir, device.torch_device,
                    evaluate=ref_engine.evaluate, resumed=resumed is not None, group=group,
                    may_compute=True,  # --ref-model's weights never change
                    planned_micro_batch_s=_reference_micro_batch_s(placement.plan, device, group.world_size),
                    stopping=_stop_requested(stop, group),
                )  # fmt: skip
            del reference
        parts = _setup_engine(model, device, host, optimizer, options, placement, run_dir, group)
        trainer = _Trainer(
            cfg, run_dir, model, data, parts.engine, device, run_log, flops, on_step, on_eval, group, stop
        )  # fmt: skip
        trainer.resumed = resumed
        trainer.init = init
        trainer.objective = preference
        trainer.plan = placement.plan
        trainer.save_copy_bytes = 0 if saving is None else saving.copy_bytes  # held from the first save on
        trainer.meter = InStepMeter(placement.plan)
        if Replacement.wanted(placement.plan):  # --update-placement auto (slide_hf/replacement.py)
            trainer.replacement = Replacement(placement.plan, ranks=group if group.world_size > 1 else None)
        with trainer.stop, parts as engine:
            if preference is not None:  # DPO: the saved pass, or one now on the starting weights (the reference)
                with _stops_the_pass(stop, group, run_dir.path):
                    run_reference(
                        cfg, preference, cache, model.model_dir, device.torch_device,
                        evaluate=engine.evaluate, resumed=resumed is not None, group=group,
                        planned_micro_batch_s=_reference_micro_batch_s(placement.plan, device, group.world_size),
                        stopping=_stop_requested(stop, group),
                    )  # fmt: skip
            first_step = trainer.run()
            # Free the host Adam state before the GPU-resident masters come back for the export, so the
            # host never holds both (Note [Resident host copies] in slide_core's engine). The whole master
            # is gathered on rank 0 alone, which exports it.
            engine.close(keep_host_state=False, master_to_root=True)
            # Export: an HF directory next to the run's other outputs, still under the signal handlers.
            save_dtype = None if cfg.save_dtype == "auto" else DTYPES[cfg.save_dtype]
            final_step = max(first_step, data.total_steps)
            model_out = run_dir.path / "model"
            model_step = final_step  # the step model/ holds: with --save-best, the best one's
            if trainer.exported is not None:  # --keep-checkpoints 0: written from the training state already
                model_out = trainer.exported
            elif main:
                if cfg.save_best:
                    model_step = load_best_for_export(host, run_dir.path, trainer.best, final_step)
                with run_dir.keeping_user_files("model"):  # the export replaces model/ whole
                    model_out = export_run_model(
                        model.slide_model,
                        host,
                        model.config,
                        run_dir.path,
                        model_step,
                        dtype=save_dtype,
                        tokenizer_dir=tokenizer_dir,
                        stop=trainer.stop,
                    )
                run_dir.record_outputs()
    losses = trainer.losses
    if first_step >= data.total_steps:  # a finished run, resumed: its model is written again, nothing to train
        if main and cfg.push_to_hub is not None:
            _push_model(cfg, run_dir.path, model_out, model_step)
        return TrainSummary(0, math.nan, math.nan, run_dir.path, model_out, [])
    if not losses:  # every step was skipped (non-finite gradients)
        raise UserError(f"no optimizer step was applied; the model was still written to {model_out}")
    # The summary is the caller's to say (`slide train` prints it, slide_hf.train() logs it): said once.
    if main and cfg.push_to_hub is not None:
        _push_model(cfg, run_dir.path, model_out, model_step)
    return TrainSummary(len(losses), losses[0], losses[-1], run_dir.path, model_out, losses)


RunGroup = ProcessGroupContext | SingleProcess
"""This process's place in a run: a data-parallel rank's process groups, or a world of one."""


def _check_reporting(cfg: TrainConfig, group: RunGroup) -> None:
    """What would otherwise fail only once the run ends or its log opens, refused in one line before any
    data is tokenized: a tracker package that is missing, and (rank 0, which pushes) a push that cannot
    happen (``HF_HUB_OFFLINE``, a repository the credentials cannot create)."""
    from slide_hf.trackers import check_trackers

    if group.rank == 0:
        check_trackers(cfg.report_to)
        if cfg.push_to_hub is not None:
            from slide_hf.hub import prepare_push

            prepare_push(cfg.push_to_hub, private=cfg.hub_private)


def _push_model(cfg: TrainConfig, run: Path, model_out: Path, step: int) -> None:
    """``--push-to-hub``: upload the exported model; a failure keeps the run and names the retry."""
    from slide_hf.hub import push_run_model

    assert cfg.push_to_hub is not None
    url = push_run_model(run, model_out, cfg.push_to_hub, private=cfg.hub_private, step=step)
    log.info("pushed %s to %s", model_out, url)


def _process_group(cfg: TrainConfig) -> RunGroup:
    """This process's place in the run, from torchrun's environment (a world of one without it); a bad
    environment is one line (docs/distributed.md)."""
    device_type = "cpu" if cfg.device == "cpu" or not torch.cuda.is_available() else "cuda"
    try:
        group = ProcessGroupContext.from_env(device_type)
    except ValueError as error:
        raise UserError(str(error)) from None
    return group


# -- setup, in the order _train runs it ----------------------------------------------------------------------
def _setup_model(cfg: TrainConfig) -> _Model:
    """A model directory, a Hub id (cached first) or a preset: its config, tokenizer and units."""
    from slide_hf import build_model, resolve_model
    from slide_hf.hub import is_hub_id, resolve_hub_model
    from slide_hf.presets import PRESETS, run_overrides

    source: str | Path = cfg.model
    if cfg.model not in PRESETS and is_hub_id(cfg.model):
        source = resolve_hub_model(cfg.model)
    try:
        config, model_dir = resolve_model(source, **run_overrides(cfg.model))
    except ValueError as error:
        raise UserError(str(error)) from error
    tokenizer = load_tokenizer(model_dir, cfg.tokenizer)
    if len(tokenizer) > config.vocab_size:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but the model only {config.vocab_size}")
    try:
        slide_model = build_model(config)
    except ValueError as error:
        raise UserError(str(error)) from error
    if model_dir is None:  # a preset trains with the bundled tokenizer: its exports carry that tokenizer's ids
        use_tokenizer_special_tokens(config, tokenizer)
    return _Model(config, model_dir, tokenizer, slide_model)


def _setup_data_once(
    cfg: TrainConfig,
    model: _Model,
    output: Path,
    group: RunGroup,
    resumed: tuple[Path, dict[str, Any]] | None = None,
) -> _Data:
    """:func:`_setup_data`; rank 0 prepares and caches the rows first and the other ranks then read its
    cache, so no two processes write it."""
    if group.rank == 0:
        data = _setup_data(cfg, model, output, group, resumed)
    group.barrier("the wait for rank 0 to prepare the data", slow=True)
    if group.rank != 0:
        data = _setup_data(cfg, model, output, group, resumed)
    return data


def _setup_data(
    cfg: TrainConfig,
    model: _Model,
    output: Path,
    group: RunGroup,
    resumed: tuple[Path, dict[str, Any]] | None = None,
) -> _Data:
    """Rows (prepared once, cached in the run directory), batches, the number of steps and the LR schedule.
    With data parallel each rank's batches are its rows of every step's global batch. A resumed run is
    refused here when its data changed, and continues the checkpoint's schedule (slide_hf/resume.py)."""
    config = model.config
    max_positions = model_positions(config)
    assert cfg.seq_len is not None  # resolved by _train
    data_options = DataOptions(
        seq_len=cfg.seq_len,
        packing=cfg.packing,
        train_on_inputs=cfg.train_on_inputs,
        chat_template=cfg.chat_template,
        max_positions=max_positions,
        vocab_size=config.vocab_size,
        max_record_bytes=cfg.max_record_bytes,
        keep_reasoning=cfg.keep_reasoning,
        system_message=cfg.system_message,
    )
    dataset, eval_set = _load_data(cfg, model.tokenizer, data_options, output / DATA_CACHE)
    if resumed is not None:
        check_same_data(*resumed, run_data_digests(cfg, dataset, eval_set), allow=cfg.allow_data_change)
    sampling: dict[str, Any] = {"rank": group.rank, "world_size": group.world_size}
    sampling["weights"] = cfg.data_weights  # a mixture's sampling proportions (slide_hf/data/mixture.py)
    batches = Batches(dataset, cfg.batch_size, cfg.grad_accum, shuffle=not cfg.no_shuffle, seed=cfg.seed, **sampling)
    epochs = cfg.epochs or (DEMO_EPOCHS if cfg.data is None else 1)
    total_steps = cfg.steps or epochs * batches.steps_per_epoch
    assert cfg.lr is not None  # resolved by _train, once, before the data
    schedule = _schedule(cfg, total_steps)
    if resumed is not None:
        schedule = resumed_schedule(*resumed, schedule, length=_length_option(cfg))
    return _Data(dataset, eval_set, batches, total_steps, schedule)


def _schedule(cfg: TrainConfig, total_steps: int) -> LRSchedule:
    """The run's lr curve over ``total_steps``; ``--warmup-ratio`` becomes steps here, where the length is
    known. A shape the peak lr rules out (a polynomial ``--lr-end`` not below the default ``--lr``) is one line."""
    assert cfg.lr is not None  # resolved by _train, once, before the data
    warmup = warmup_from_ratio(total_steps, cfg.warmup_ratio) if cfg.warmup_ratio > 0 else cfg.warmup_steps
    try:
        return LRSchedule(
            cfg.lr,
            cfg.lr_schedule,
            warmup,
            total_steps,
            min_lr_ratio=cfg.min_lr_ratio,
            decay_fraction=cfg.decay_fraction,
            decay_shape=cfg.decay_shape,
            cycles=cfg.lr_cycles,
            power=cfg.lr_power,
            end_lr=cfg.lr_end,
            timescale=cfg.lr_timescale,
        )
    except ValueError as error:
        raise UserError(f"{option('lr_schedule', cfg.lr_schedule.value)}: {error}") from None


def _length_option(cfg: TrainConfig) -> str:
    """The option that set the run's length, for messages."""
    return "steps" if cfg.steps is not None else "epochs"


def _output_disk(cfg: TrainConfig, model: _Model, optimizer: Optimizer, total_steps: int) -> disk.OutputDisk:
    """What the run's checkpoints, weights-only saves and export take (slide_hf/planner/output_disk.py),
    from the arrays the engine will write for this optimizer."""
    from slide_hf.export import resolve_dtype

    units = model.slide_model.units
    export_dtype = resolve_dtype(None if cfg.save_dtype == "auto" else DTYPES[cfg.save_dtype], model.config)
    return disk.run_output_disk(
        cfg,
        [unit.layout.numel for unit in units],
        optimizer.state_arrays,
        params=sum(unit.layout.param_numel for unit in units),
        export_itemsize=torch.empty((), dtype=export_dtype).element_size(),
        total_steps=total_steps,
    )


def _plan_saves(cfg: TrainConfig, outputs: disk.OutputDisk, plan: Plan, output: Path) -> SaveCost | None:
    """What each mid-run checkpoint will cost (slide_hf/planner/save_cost.py), as `slide plan` prices it,
    logged; a warning when --save-async's copy cannot fit beside the run's host peak, so the saves will be
    written in the foreground (each save checks the host again: ``_room_for_a_copy``). None for a run that
    saves only at its end (always in the foreground)."""
    if not (cfg.save_every > 0 or cfg.save_best) or outputs.export_only:
        return None
    saving = save_cost(
        outputs,
        background=cfg.save_async,
        host_peak_bytes=plan.host_peak_bytes,
        host_available=available_host_bytes(),
        bandwidths=plan.inputs.bandwidths,
        write_gbps=checkpoint_write_gbps(output),
    )
    if saving.background and not saving.copy_fits:
        log.warning("%s: %s", option("save_async"), saving.describe())
    else:
        log.info("%s", saving.describe())
    return saving


def _setup_device(options: RunOptions, group: RunGroup) -> Device:
    """The ``--device`` plugin (``auto``: cuda, rocm on a HIP build, else cpu), closed until the run starts;
    with data parallel over GPUs, this rank's GPU (``ProcessGroupContext.device_index``)."""
    index = group.device_index  # 0 without a GPU of its own
    return make_device(options.device, options.gpu_memory_bytes, index=index)


def _setup_compute_dtype(cfg: TrainConfig, device: Device, group: RunGroup) -> DType:
    """The compute dtype of a run that gave no ``--dtype``: ``device``'s (bf16 on a GPU, fp32 on a CPU without
    native bf16: slide_hf/device_defaults.py), logged with why. With data parallel every rank takes rank 0's,
    so all compute alike even on unlike hosts."""
    from slide_hf.device_defaults import default_compute_dtype

    choice = group.broadcast_object(default_compute_dtype(device.is_accelerator, cfg.master), "rank 0's compute dtype")
    log.info("%s", choice.describe())
    return choice.dtype


def _compute_dtype(cfg: TrainConfig) -> torch.dtype:
    """The run's compute dtype, given or chosen for the device by now (``_setup_compute_dtype``)."""
    assert cfg.dtype is not None  # _train chooses one before anything computes
    return DTYPES[cfg.dtype]


def _setup_optimizer(cfg: TrainConfig, options: RunOptions) -> Optimizer:
    """The ``--optimizer`` plugin with the run's AdamW hyperparameters, compiled off the critical path."""
    adam = AdamWConfig(
        cfg.adam_beta1,
        cfg.adam_beta2,
        cfg.adam_eps,
        cfg.weight_decay,
        state_format=cfg.optimizer_state,
        state_seed=cfg.seed,
    )
    return make_optimizer(options.optimizer, adam)


def _setup_placement(
    model: _Model, device: Device, options: RunOptions, group: RunGroup, optimizer: Optimizer
) -> Placement:
    """Refuse what cannot fit before allocating anything; spend spare GPU memory on resident units. Every
    rank takes rank 0's choice of resident, offloaded, streamed and movable units: a resident unit's
    collectives differ from a sliding one's, and the units that move between steps move on every rank
    (Note [Ranks place alike] in slide_hf/replacement.py), so the ranks must place alike."""
    placement = place_units(  # rank 0's is the one taken, so rank 0 alone measures an unmeasured machine
        model.slide_model, device, options, optimizer=optimizer, replaceable=True, measure_machine=group.rank == 0
    )
    plan = placement.plan
    chosen = (placement.resident, placement.offloaded, placement.streamed, plan.inputs.streamable_units)
    resident, offloaded, streamed, movable = group.broadcast_object(chosen, "rank 0's placement")
    if movable != plan.inputs.streamable_units:  # a host whose measured rates placed otherwise (the staging)
        from slide_hf.planner import make_plan

        plan = make_plan(dataclasses.replace(plan.inputs, streamable_units=movable))
    return dataclasses.replace(placement, plan=plan, resident=resident, offloaded=offloaded, streamed=streamed)


def _setup_run_log(cfg: TrainConfig, output: Path) -> RunLog:
    return RunLog(
        output,
        config_dict(cfg),
        metrics=cfg.metrics,
        report_to=cfg.report_to,
        inputs=tuple(p for p in (*data_sources(cfg), cfg.eval_data, cfg.resume) if isinstance(p, Path)),
    )


def _setup_weights(
    cfg: TrainConfig, model: _Model, master_format: MasterFormat, group: RunGroup, init: InitPoint | None = None
) -> HostParameters:
    """The fp32 master: HF weights, a preset's seeded random init, or with ``--init-from`` (``init``) the
    checkpoint's master, stored in ``master_format``: ``--master`` as the plan resolved it for this dtype,
    optimizer and device (``PlanInputs.master_format``), so the run holds what the plan priced. The engine
    pins what it streams and gives back what lives on the GPU. With data parallel a rank writes (and so
    holds) only its shards of the master (Note [Sharded master] in slide_core's engine/host_pipeline.py);
    the final drain gathers it whole."""
    from slide_hf import init_random, load_weights

    log.info("host master: %s", master_format)
    host = HostParameters(model.slide_model, master_format=master_format)
    host.keep_shards(UnitShards(group, model.slide_model.units).partial())  # none in a world of one
    if init is not None:
        load_initial_master(init, host)
    elif model.model_dir is None:
        init_random(model.slide_model, host, model.config, seed=cfg.seed)
    else:
        try:
            load_weights(model.slide_model, host, model.model_dir)
        except ValueError as error:  # CheckpointError, ModelFilesError: one line naming file and tensor
            raise UserError(str(error)) from None
    return host


def _log_run(
    cfg: TrainConfig,
    model: _Model,
    data: _Data,
    device: Device,
    optimizer: Optimizer,
    group: RunGroup,
) -> float:
    """Derived quantities, printed once; returns the model FLOPs per token."""
    assert cfg.seq_len is not None  # resolved before setup (slide_hf/defaults.py)
    world_size = group.world_size
    from slide_hf.adapters import attention_summary

    params = sum(unit.layout.param_numel for unit in model.slide_model.units)
    log.info(
        "model %s: %.1fM params, %d blocks | data: %s, %d sequences of %d tokens | %d steps of %d tokens | "
        "device %s (%s) | optimizer %s",
        _describe_model(cfg, model.model_dir),
        params / 1e6,
        len(model.slide_model.blocks),
        data.dataset.source,
        len(data.dataset),
        cfg.seq_len,
        data.total_steps,
        cfg.batch_size * cfg.grad_accum * cfg.seq_len * world_size,
        device.facts().name,
        cfg.dtype,
        type(optimizer).__name__,
    )
    log.info("attention: %s", attention_summary(model.slide_model, device.torch_device.type, _compute_dtype(cfg)))
    linear = getattr(model.slide_model, "linear_attention", None)
    if linear is not None:  # decided (a check on the GPU) and logged here, before the engine runs
        linear.path_for(device.torch_device, _compute_dtype(cfg))
    return flops_per_token(model.config, params, cfg.seq_len)


def _setup_engine(
    model: _Model,
    device: Device,
    host: HostParameters,
    optimizer: Optimizer,
    options: RunOptions,
    placement: Placement,
    run_dir: RunDir,
    group: RunGroup,
) -> EngineParts:
    """The tiers (each tier that keeps files gets its own locked folder in --nvme-dir) and the engine."""

    def scratch() -> Path:
        assert options.nvme_dir is not None  # the options' rules refused a tier on disk without it
        return run_dir.scratch(options.nvme_dir)  # each rank its own locked folder (RunDir.scratch)

    return open_engine(
        model.slide_model, device, host, optimizer, options, placement, scratch=scratch, process_group=group
    )


# -- the loop -----------------------------------------------------------------------------------------------
def _stop_requested(stop: _StopRequests, group: RunGroup) -> Callable[[], bool]:
    """Whether a long pass between steps (DPO's reference pass, an evaluation) should stop now (Note [A stop
    during the reference pass] in preference/reference.py, Note [A stop cuts an evaluation short]): a signal
    this process took, or, with data parallel, one any rank took, summed over the ranks as a step sums them
    (Note [Stop on every rank]), so every rank stops after the same part of the pass."""

    def stopping() -> bool:
        if group.world_size > 1:
            stop.agree(group.sum_counts(stop.local_flags(), "the ranks' stop requests during a pass between steps"))
        return stop.agreed is not None

    return stopping


@contextlib.contextmanager
def _stops_the_pass(stop: _StopRequests, group: RunGroup, output: Path) -> Iterator[None]:
    """A reference pass stopped by a signal ends the run in one line with the signal's exit status: nothing
    is trained or saved yet, so the run starts again (``--overwrite`` replaces only slide's files)."""
    try:
        yield
    except PassStopped as stopped:
        name = stop.requested or stop.agreed
        again = f"start it again with the same command and {option('overwrite')}"
        raise RunStopped(
            f"stopped by {name} during the {stopped.label}, after {stopped.done} of its {stopped.total} "
            f"micro-batches{' on each rank' if group.world_size > 1 else ''}; nothing is trained or saved yet in "
            f"{output}: {again}",
            stop.exit_code,
        ) from None


def _reference_micro_batch_s(plan: Any, device: Any, world_size: int) -> float | None:
    """The plan's seconds per micro-batch of DPO's reference pass (with data parallel, each rank's: its
    shard of each load, the rest all-gathered at the planner's stated link rate); None on the CPU device
    (the planner's rates are a GPU's) or without one."""
    if not device.is_accelerator or plan.reference_step_s is None:
        return None
    step_s = float(plan.reference_step_s)
    if world_size > 1:
        from slide_hf.planner.distributed import Interconnect, ranks_reference_step_s

        step_s = ranks_reference_step_s(plan, world_size, Interconnect().intra_gbps)
    return step_s / plan.inputs.grad_accum


class _Trainer:
    """The loop over optimizer steps and what it does between them (evaluate, checkpoint), as methods over
    one run's state. ``stop`` turns SIGINT/SIGTERM into a checkpoint at the end of the current step.

    ``group``: with data parallel, every rank runs the same loop (the engine's collectives need it), but
    only rank 0 (``main``, which has the ``run_log``) logs, reports progress and calls the callbacks."""

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: RunDir,
        model: _Model,
        data: _Data,
        engine: Engine,
        device: Device,
        run_log: RunLog | None,
        flops_per_token: float,
        on_step: Callable[[dict[str, Any]], None] | None,
        on_eval: Callable[[dict[str, Any]], None] | None,
        group: RunGroup,
        stop: _StopRequests,
    ) -> None:
        self.cfg, self.run_dir, self.output, self.data, self.model = cfg, run_dir, run_dir.path, data, model
        self.engine, self.device, self.run_log = engine, device, run_log
        self.group = group
        self.main = group.rank == 0
        self.flops_per_token = flops_per_token
        self.on_step, self.on_eval = on_step, on_eval
        self.stop = stop
        """The run's stop requests, installed by the caller around the engine's life (the reference pass too)."""
        self.checkpoints = self.output / "checkpoints"
        # What `slide export` needs to turn any checkpoint of this run into an HF directory.
        self.run_state = {
            "model": cfg.model,
            "seed": cfg.seed,
            "total_steps": data.total_steps,
            "config": config_dict(cfg),
            # What a resume checks and continues: the lr curve (with any extension) and the rows trained on.
            "schedule": data.schedule.to_dict(),
            "data_digest": run_data_digests(cfg, data.dataset, data.eval_set),
        }
        tokenizer = model.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.evaluator: _Evaluator | None = None
        if data.eval_set is not None:  # exp of a preference run's pair loss is no perplexity
            self.evaluator = _Evaluator(engine, data.eval_set, cfg.batch_size, group, perplexity=not cfg.preference)
        self.losses: list[float] = []
        self.best: dict[str, Any] = {}  # the published best (best.json), what pruning protects
        self.best_candidate: dict[str, Any] | None = None  # a better one whose checkpoint is not published yet
        self.last_saved: int | None = None
        # --save-async: checkpoints written on a thread (Note [Background snapshot] in slide_core's
        # checkpoint/background.py); one process only (the options' rules).
        self.saver = BackgroundSaver() if cfg.save_async and group.world_size == 1 else None
        self.resumed: tuple[Path, dict[str, Any]] | None = None  # the checkpoint and its state, when resuming
        self.init: InitPoint | None = None  # --init-from: the checkpoint this new run starts from
        self.objective: PreferenceObjective | None = None  # DPO/SimPO: the heads of the training and held-out pairs
        self.steps_before = 0  # Adam steps before this run's first (--init-from): the engine counts them too
        self.progress: Progress | None = None
        self._process = psutil.Process()
        self.plan: Any = None  # the placed plan, whose terms the run's log measures (slide_hf/plan_check.py)
        self.save_copy_bytes = 0  # the plan's --save-async copy, held beside the engine (slide_hf/planner/save_cost.py)
        self.step_times_s: list[float] = []
        self.grad_norms: list[float | None] = []  # each step's, beside its time: a clipped step defers the next
        self.meter: InStepMeter | None = None  # each term of the steps beside the plan's (slide_hf/in_step_rates.py)
        self.replacement: Replacement | None = None  # moves units from the measured rates (slide_hf/replacement.py)
        self._streamed_logged: tuple[str, ...] | None = None  # the placement the metrics last named
        self.exported: Path | None = None  # model/, when --keep-checkpoints 0 wrote it from the training state

    def run(self) -> int:
        """Train inside the running engine from the resumed step (or 0) to the last; the final state is
        checkpointed whatever --save-every says, or with --keep-checkpoints 0 exported from the training
        state (a checkpoint only where that export cannot finish). Returns the first step."""
        cfg, data, engine, stop = self.cfg, self.data, self.engine, self.stop
        # Resume: each unit's arrays stream to where the unit lives.
        first_step = 0
        origin = None  # a run started with --init-from keeps its record, in every checkpoint
        if self.resumed is not None:
            first_step = _resume(*self.resumed, engine, data.batches, self.run_state, self.run_dir, self.group)
            origin = init_record(*self.resumed)
        elif self.init is not None:
            restore_adam_state(self.init, engine)
            origin = self.init.record()
        if origin is not None:
            self.run_state["init_from"] = origin
            self.steps_before = int(origin["adam_step"])
        self.last_saved = first_step if self.resumed is not None else None
        self.best.update(read_best(self.output) if self.resumed is not None and cfg.save_best else {})
        if self.run_log is not None:
            self.run_log.start(first_step)
        self.device.reset_peak_memory()
        has_gpu = self.device.torch_device.type != "cpu"
        if self.main:
            self.progress = Progress(data.total_steps, first_step=first_step, has_gpu=has_gpu, log_every=cfg.log_every)
        # A background save still in flight when the run fails is finished before the error goes on.
        with self.progress or contextlib.nullcontext(), self.saver or contextlib.nullcontext():
            for step in range(first_step, data.total_steps):
                # LR for this step, then forward/backward over its micro-batches, clip and step (one engine call).
                try:
                    micro_batches = data.batches.next_step()
                    result = engine.step(micro_batches, lr=data.schedule.lr_at(step))
                except torch.OutOfMemoryError as error:
                    raise UserError(_oom_message(error, cfg, step + 1)) from error
                except EngineError as error:
                    raise UserError(str(error)) from error
                if result.skipped:
                    log.warning("step %d skipped exactly: non-finite gradients (nothing applied)", step + 1)
                elif not math.isfinite(result.loss):
                    run_step = result.step - self.steps_before
                    raise UserError(f"the loss became {result.loss} at step {run_step}; try a lower {option('lr')}")
                else:
                    self.losses.append(result.loss)
                # Logging.
                self._log_step(result, micro_batches)
                # Evaluation: every --eval-every steps, and after the last step.
                done = step + 1
                if self.evaluator is not None and (
                    done == data.total_steps or (cfg.eval_every and done % cfg.eval_every == 0)
                ):
                    self.evaluate(done)
                # Checkpoint: every --save-every steps, and when asked to stop (SIGINT/SIGTERM), unless the
                # evaluation just saved this very step as the best. A background save that has finished is
                # collected (its pruning done, its failure raised) without waiting for one that has not.
                self._collect(wait=False)
                stopping = self._stopping()
                if ((cfg.save_every and done % cfg.save_every == 0) or stopping) and self.last_saved != done:
                    self.last_saved = self.checkpoint(done, wait=stopping)
                # Weights-only save: every --save-weights-every steps but the last, whose weights are the export.
                if cfg.save_weights_every and done % cfg.save_weights_every == 0 and done < data.total_steps:
                    self.save_weights(done)
                # Termination: a stop request ends the run here, its checkpoint saved.
                if stopping:
                    self._collect(wait=True)
                    raise stop.stopped(f"after step {done}; its checkpoint is saved", self.output)
            # Training is over. The final state is checkpointed first, whatever --save-every says, so the
            # export can fail (full disk, a signal) without losing the run; with --keep-checkpoints 0 the
            # export is written from the training state instead, a checkpoint only where it cannot finish.
            final_step = max(first_step, data.total_steps)
            if cfg.keep_checkpoints == 0:  # also a finished run resumed from its stop's checkpoint, deleted then
                self.exported = self.export_from_training_state(final_step)
            elif self.last_saved != final_step:
                self.checkpoint(final_step, wait=True)
            self._collect(wait=True)
        if self._stopping() and self.exported is None:
            raise stop.stopped(f"after step {final_step}; its checkpoint is saved", self.output)
        if self.main and self.plan is not None and self.step_times_s:
            gpu_peak = self.device.peak_memory_bytes() if self.device.is_accelerator else None
            terms = self.meter.terms() if self.meter is not None else None
            check = PlanCheck.of(
                self.plan,
                self.step_times_s,
                gpu_peak_bytes=gpu_peak,
                terms=terms,
                host_buffers_bytes=self.engine.host_allocations.total_bytes,
                world_size=self.group.world_size,
                grad_norms=self.grad_norms,
                max_grad_norm=self.cfg.max_grad_norm,
                extra_host_bytes=self.save_copy_bytes,
            )
            log.info("%s", check.line())
            if self.device.is_accelerator and self.meter is not None:
                learn_rates(self.meter)
        return first_step

    def _stopping(self) -> bool:
        """Whether the run stops after this step: what the ranks agreed (Note [Stop on every rank]), never
        a rank's own signal alone while other ranks run."""
        return self.stop.agreed is not None

    def _log_step(self, result: Any, micro_batches: list[Any]) -> None:
        self.step_times_s.append(result.wall_s)
        self.grad_norms.append(result.grad_norm)
        times = self.engine.unit_times()
        if self.meter is not None:
            self.meter.add(times)
        placement = self._placement(result.step - self.steps_before, times)
        real_tokens = _real_tokens(micro_batches, self.pad_id)
        # One host collective a step: every rank's rows (the engine's counts already are), its signals and,
        # for DPO/SimPO, its sums of TRL's rewards/* and logps/* (a CPU-GPU sync; none for SFT). Counts
        # travel as float64, exact below 2**53.
        counts = [real_tokens, *self.stop.local_flags()]
        metric_sums = step_metric_sums(self.objective)
        summed = torch.tensor(counts, dtype=torch.float64)
        if metric_sums is not None:
            summed = torch.cat([summed, metric_sums])
        self.group.all_reduce_host_(summed, "the sum of the step's real tokens, signals and metrics")
        real_tokens, *flags = (int(value) for value in summed[: len(counts)].tolist())
        self.stop.agree(flags)
        preference = {} if metric_sums is None else metric_means(summed[len(counts) :])
        if self.run_log is None:
            return
        record = {
            "step": result.step - self.steps_before,  # the engine's Adam count, less the steps before this run
            "loss": result.loss,
            "lr": result.lr,
            "tokens": real_tokens,
            "loss_tokens": result.loss_tokens,
            "padded_tokens": result.tokens,
            "tokens_per_s": real_tokens / result.wall_s,
            "step_time_s": result.wall_s,
            "tflops": self.flops_per_token * result.tokens / result.wall_s / 1e12,  # padding is computed too
            "overlap": _overall_overlap(times),
            "grad_norm": result.grad_norm,
            "skipped": result.skipped,
            "gpu_mem_peak_gb": self.device.peak_memory_bytes() / 1e9,
            "host_rss_gb": self._process.memory_info().rss / 1e9,
            **preference,
        }
        if placement is not None:
            record["streamed_units"] = placement
        assert self.progress is not None
        self.progress.update(record)  # adds the time remaining, eta_s
        self.run_log.record(record)
        if self.on_step is not None:
            self.on_step(dict(record))

    def _placement(self, step: int, times: Any) -> str | None:
        """The units this step updated on the GPU as they streamed (compact), where that changed since the
        metrics last said it (the first step says it); then the step's times to the placement loop, which
        may move units before the next step (slide_hf/replacement.py)."""
        replacement = self.replacement
        if replacement is None:
            return None
        ran = replacement.streamed
        change = replacement.after_step(step, times, self.engine)
        if change is not None and self.meter is not None:
            self.meter.placed(change.streamed)
        if ran == self._streamed_logged:
            return None
        self._streamed_logged = ran
        return compact_units(ran, replacement.order)

    def evaluate(self, step: int) -> None:
        """Eval loss at ``step``; with --save-best, a new best is checkpointed and kept from pruning."""
        assert self.evaluator is not None
        # DPO/SimPO: the held-out pairs' own head computes their loss (Note [A head per pair set]), and
        # TRL's eval_rewards/* and eval_logps/* join the record.
        with evaluation_scope(self.objective):
            cut = self.evaluator.run(step, stopping=_stop_requested(self.stop, self.group))
        metrics = eval_metrics(self.objective, self.group)  # taken either way: a cut one's are partial sums
        if cut is None:  # Note [A stop cuts an evaluation short]: the step's checkpoint and the stop follow
            if self.main:
                log.info("evaluation at step %d cut short by %s; no record", step, self.stop.agreed)
            return
        record = cut | metrics
        if self.run_log is None:  # not rank 0: only the checkpoint below is every rank's
            if self.cfg.save_best and record["eval_loss"] < self.best.get("eval_loss", math.inf):
                if self.last_saved != step:
                    self.last_saved = self._save(step)
                self.best.update(step=step, eval_loss=record["eval_loss"])
            return
        assert self.progress is not None
        self.progress.evaluation(record)
        self.run_log.record(record)
        if self.on_eval is not None:
            self.on_eval(dict(record))
        if self.cfg.save_best and record["eval_loss"] < (self.best_candidate or self.best).get("eval_loss", math.inf):
            # Saved, then named in best.json, then the older best pruned: a crash between leaves best.json
            # naming a checkpoint that exists. The next evaluation compares with the candidate at once; it
            # becomes the best (best.json, what pruning protects) only once its checkpoint is published
            # (--save-async: when the save is collected), so until then the older best stays protected.
            path = _checkpoint_path(self.checkpoints, step)
            candidate = {"step": step, "eval_loss": record["eval_loss"], "path": str(path.relative_to(self.output))}
            self.best_candidate = candidate
            if self.last_saved != step:
                self.last_saved = self._save(step, then=lambda saved: self._published_best(candidate), wait=False)
            else:
                self._collect(wait=True)
                self._published_best(candidate)
            log.info("best eval loss so far: %.4f at step %d (%s)", record["eval_loss"], step, path)

    def _published_best(self, candidate: dict[str, Any]) -> None:
        """The checkpoint of ``candidate`` is on disk: it becomes the best, named in best.json, then the
        older best is pruned."""
        self.best.clear()
        self.best.update(candidate)
        if self.best_candidate is candidate:
            self.best_candidate = None
        _write_best(self.checkpoints, self.best)
        self._prune()

    def checkpoint(self, step: int, *, wait: bool = True) -> int:
        """Save the whole run state at ``step``, then prune to the retention rule (:meth:`_prune`) once it
        is published; with --save-async and not ``wait``, the write goes on in the background."""
        return self._save(step, then=lambda path: self._prune(), wait=wait)

    def _protected(self) -> list[Path]:
        """What pruning never deletes (--save-best): the published best, and a better candidate once its
        checkpoint is written (a path not on disk protects nothing)."""
        return [self.output / best["path"] for best in (self.best, self.best_candidate or {}) if best.get("path")]

    def _prune(self) -> None:
        """Keep the newest --keep-checkpoints and the best one (Note [Retention] in slide_core's
        checkpoint/retention.py, docs/checkpoints.md "Retention"): at most --keep-checkpoints + 1 once a save
        is published; checkpoints of abandoned lines go first. Rank 0 alone prunes, with no save in flight.
        With --keep-checkpoints 0 the one a stop writes is kept: the run resumes from it."""
        if self.main:
            prune(self.checkpoints, max(self.cfg.keep_checkpoints, 1), protect=self._protected())

    def export_from_training_state(self, step: int) -> Path:
        """--keep-checkpoints 0 (Note [Export only] in slide_hf/run_export.py): write ``model/`` from the
        masters as the running engine keeps them, one unit at a time; when it cannot finish, the checkpoint
        of ``step`` is written in its place. Once it is written, the run's checkpoints (those a stop left)
        are deleted: this option keeps none."""
        master = self.engine.checkpoint_arrays()["master"]  # note: waits for every pending update (a host sync)

        def keep() -> None:
            self._save(step)

        with self.run_dir.keeping_user_files("model"):  # the export replaces model/ whole
            exported = export_run_model(
                self.model.slide_model,
                streamed_master(self.model.slide_model, master),
                self.model.config,
                self.output,
                step,
                dtype=None if self.cfg.save_dtype == "auto" else DTYPES[self.cfg.save_dtype],
                tokenizer_dir=self.output / "tokenizer",
                stop=self.stop,
                keep=None if self.last_saved == step else keep,  # a finished run resumed: it is on disk
            )
        removed = prune(self.checkpoints, 0)
        if removed:
            names = ", ".join(p.name for p in removed)
            log.info(
                "deleted %s: %s keeps no checkpoint once the model is written", names, option("keep_checkpoints", 0)
            )
        else:
            log.info(
                "model of step %d written from the training state; no checkpoint kept (%s)",
                step,
                option("keep_checkpoints", 0),
            )
        self.run_dir.record_outputs()
        return exported

    def _make_room(self) -> None:
        """--save-delete-first: before a save writes, delete down to --keep-checkpoints - 1 (the best
        aside), so that the disk never holds more than --keep-checkpoints; a failure during the write then
        leaves one fewer. Every rank waits for rank 0's deletion before it writes its shard."""
        if self.main:
            removed = prune(self.checkpoints, self.cfg.keep_checkpoints - 1, protect=self._protected(), leftovers=False)
            if removed:
                names = ", ".join(p.name for p in removed)
                log.info("deleted %s before writing the next checkpoint (%s)", names, option("save_delete_first"))
        self.group.barrier("the wait for rank 0 to make room for the checkpoint")

    def _save(self, step: int, then: Callable[[Path], None] = lambda path: None, *, wait: bool = True) -> int:
        """Write the whole run state at ``step`` as one checkpoint, then call ``then`` with its path once
        it is published (rank 0 prunes there). With --save-async and not ``wait`` the state is copied
        between steps and written on a thread (Note [Background snapshot]); ``then`` runs when a later
        :meth:`_collect` finds it written. Logs how long the save held training up, which `slide plan`
        prices (slide_hf/planner/save_cost.py)."""
        began = time.perf_counter()
        self._collect(wait=True)  # one save at a time
        waited = time.perf_counter() - began
        arrays = self.engine.checkpoint_arrays()  # note: waits for every pending update (a host sync), only when saving
        batches = self.data.batches
        state = {**self.run_state, "data": {"epoch": batches.position.epoch, "index": batches.position.index}}
        state["rng"] = torch.get_rng_state().tolist()
        state["engine"] = self.engine.schedule_state()
        if self.cfg.save_delete_first:
            self._make_room()
        if self.saver is not None and not wait and self._room_for_a_copy(checkpoint_nbytes(arrays, state), self.saver):
            self.saver.submit(self.checkpoints, step, arrays, state, then=lambda path: self._published(path, then))
            self._log_pause(step, began, "copied; written in the background", waited)
            return step
        writing = time.perf_counter()
        try:
            saved = save_checkpoint(self.checkpoints, step, arrays, state, self.group)
        except CheckpointWriteError as error:
            raise UserError(error.strerror) from error
        if self.main and self.group.world_size == 1:  # the rate the next plan of a save on this disk takes
            learn_checkpoint_write(self.checkpoints, checkpoint_nbytes(arrays, state), time.perf_counter() - writing)
        self._published(saved, then)
        self._log_pause(step, began, "written", waited)
        return step

    def _log_pause(self, step: int, began: float, how: str, waited: float) -> None:
        """The run's log: how long the save of ``step`` held training up, ``waited`` of it for the save
        before it to be written (--save-async saves closer together than a write takes)."""
        if not self.main:
            return
        paused = time.perf_counter() - began
        previous = f" ({waited:.3g} s of it waiting for the previous save's write)" if waited >= 0.01 else ""
        log.info("checkpoint of step %d %s: training paused %.3g s%s", step, how, paused, previous)

    def _published(self, saved: Path, then: Callable[[Path], None]) -> None:
        """``saved`` is published: its ``then`` (pruning, best.json) first, so that the record of the run's
        files that follows holds what stays on disk."""
        if self.main:
            log.info("checkpoint written to %s", saved)
        then(saved)
        if self.main:
            self.run_dir.record_outputs()  # the new checkpoint's files are slide's (slide_hf/run_files.py)

    def _room_for_a_copy(self, nbytes: int, saver: BackgroundSaver) -> bool:
        """Whether host memory can hold the copy a background save writes from, beside the copies the
        saver keeps from its last save (Note [Snapshot buffers are kept] in slide_core's
        checkpoint/background.py); when it cannot, the save is written in the foreground this time, with a
        warning, rather than push the host into swap."""
        available = psutil.virtual_memory().available
        if available >= nbytes - saver.held_bytes:
            return True
        log.warning(
            "%s: a background checkpoint copies %s to host memory and %s is available; this one is written in "
            "the foreground",
            option("save_async"),
            format_size(nbytes),
            format_size(available),
        )
        return False

    def _collect(self, *, wait: bool) -> None:
        """Collect a background save (--save-async): its pruning runs and its failure is raised here, in
        the training thread, as one line. ``wait``: block until it is written (note: waits on the disk)."""
        if self.saver is None:
            return
        try:
            if wait:
                self.saver.wait()
            else:
                self.saver.poll()
        except CheckpointWriteError as error:
            raise UserError(error.strerror) from error

    def save_weights(self, step: int) -> None:
        """--save-weights-every: the weights of ``step`` alone, an HF model directory, read unit by unit
        from where the engine keeps each master (slide_hf/run_export.py). None when the run stops: a stop
        is quick, and the step's checkpoint holds these weights."""
        if self._stopping():
            if self.main:
                log.info("the weights-only save of step %d is skipped: the run stops after its checkpoint", step)
            return
        master = self.engine.checkpoint_arrays()["master"]  # note: waits for every pending update (a host sync)
        if not self.main:
            return
        saved = export_weights(
            self.model.slide_model,
            master,
            self.model.config,
            self.output,
            step,
            dtype=None if self.cfg.save_dtype == "auto" else DTYPES[self.cfg.save_dtype],
            tokenizer_dir=self.output / "tokenizer",
        )
        self.run_dir.record_outputs()
        log.info("weights of step %d written to %s", step, saved)


DATA_CACHE = ".data-cache"
"""Prepared rows, cached inside the run directory: a restart or resume reads them instead of re-tokenizing."""


def _load_data(cfg: TrainConfig, tokenizer: Any, options: DataOptions, cache_dir: Path) -> tuple[Any, Any]:
    """``(train rows, eval rows or None)``: --eval-fraction holds out whole examples of --data before
    packing, so no document is in both; --eval-data is prepared with the same options."""
    from slide_hf.data.notes import each_note_once

    if cfg.preference:  # pairs, kept together in rows and split by pair (slide_hf/data/preference.py)
        return load_preference_data(cfg, tokenizer, options)
    with each_note_once():  # a note on the template is said once for --data and --eval-data
        if cfg.eval_fraction > 0:
            return load_split(
                cfg.data, tokenizer, options, eval_fraction=cfg.eval_fraction, seed=cfg.seed, cache_dir=cache_dir
            )
        dataset = load_dataset(cfg.data, tokenizer, options, cache_dir=cache_dir)
        eval_set = load_dataset(cfg.eval_data, tokenizer, options, cache_dir=cache_dir) if cfg.eval_data else None
    return dataset, eval_set


def _real_tokens(micro_batches: list[Any], pad_id: int | None) -> int:
    """Tokens that are not row padding: the trailing run of pad ids without labels in each row is padding
    (an EOS inside or at the end of a document carries a label, so it counts)."""
    total = 0
    for micro_batch in micro_batches:
        input_ids, labels = micro_batch[0], micro_batch[1]
        if pad_id is None:
            total += int(input_ids.numel())
            continue
        padding = (input_ids == pad_id) & (labels == -100)
        trailing = padding.flip(-1).to(torch.int32).cumprod(-1).sum()
        total += int(input_ids.numel()) - int(trailing)
    return total


class _Evaluator:
    """Evaluation through the running engine: the held-out rows in order, a bounded group of micro-batches
    per engine call so host memory stays small on a large eval set; nothing of the optimizer is touched.

    With data parallel rank ``r`` evaluates micro-batches ``r, r + N, ...`` and the loss sums and token
    counts are summed over the ranks. Every evaluation load is an all-gather, so every rank must evaluate
    as many micro-batches in the same groups (Note [Every rank evaluates as many micro-batches] in
    slide_hf/data/batches.py).

    Note [A stop cuts an evaluation short]: an evaluation of a large held-out set runs for minutes between
    two steps, longer than a scheduler's notice before it kills the job. So a SIGINT or SIGTERM is looked
    for after each group (every rank together, with data parallel): the evaluation is dropped, no record
    is written, and the run checkpoints the step just done and stops, as after any step. Tested by
    tests/hf/test_train_faults.py."""

    GROUP = 64

    def __init__(self, engine: Engine, rows: Any, batch_size: int, group: RunGroup, *, perplexity: bool = True) -> None:
        self.engine, self.rows, self.batch_size, self.group = engine, rows, batch_size, group
        self.perplexity = perplexity
        """Whether the record has the perplexity, exp of the mean token loss (SFT's)."""

    def run(self, step: int, *, stopping: Callable[[], bool] | None = None) -> dict[str, Any] | None:
        """The evaluation record at ``step``; None where ``stopping``, asked after each group, said to stop
        (Note [A stop cuts an evaluation short])."""
        began = time.perf_counter()
        loss_sum, loss_tokens = 0.0, 0
        group: list[Any] = []
        rank, world_size = self.group.rank, self.group.world_size
        for micro_batch in eval_batches(self.rows, self.batch_size, rank=rank, world_size=world_size):
            group.append(micro_batch)
            if len(group) == self.GROUP:
                loss_sum, loss_tokens = self._add(group, loss_sum, loss_tokens)
                group = []
                if stopping is not None and stopping():
                    return None
        if group:
            loss_sum, loss_tokens = self._add(group, loss_sum, loss_tokens)
        sums = {"loss_sum": loss_sum, "loss_tokens": float(loss_tokens)}
        self.group.sum_values(sums, list(sums), "the sum of the evaluation's losses", ready=_nothing)
        loss_sum, loss_tokens = sums["loss_sum"], int(sums["loss_tokens"])
        loss = loss_sum / loss_tokens if loss_tokens else math.nan
        record: dict[str, Any] = {"step": step, "eval_loss": loss}
        if self.perplexity:
            record["perplexity"] = math.exp(min(loss, 700.0))
        return record | {"eval_loss_tokens": loss_tokens, "eval_time_s": time.perf_counter() - began}

    def _add(self, group: list[Any], loss_sum: float, loss_tokens: int) -> tuple[float, int]:
        try:
            result = self.engine.evaluate(group)
        except EngineError as error:
            raise UserError(str(error)) from error
        return loss_sum + result.loss_sum, loss_tokens + result.loss_tokens


def _nothing() -> None:
    """Nothing to wait for: the values to sum are complete."""


def _checkpoint_path(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"step-{step:08d}"


def _write_best(checkpoints: Path, best: dict[str, Any]) -> None:
    """``checkpoints/best.json`` names the checkpoint with the lowest eval loss (what --save-best keeps)."""
    target = checkpoints / "best.json"
    temp = checkpoints / f".best.json.tmp-{os.getpid()}"
    try:
        temp.write_text(json.dumps(best, indent=1) + "\n", encoding="utf-8")
        os.replace(temp, target)
    except OSError as error:
        temp.unlink(missing_ok=True)
        log.warning("cannot write %s (%s); the best checkpoint is %s", target, error.strerror, best.get("path"))


def _describe_model(cfg: TrainConfig, model_dir: Path | None) -> str:
    """How the first log line names the model. A preset says ``random weights`` there: a run on a preset
    must never pass for a fine-tune of real weights in anyone's log."""
    if cfg.init_from is not None:
        return f"{cfg.model} (weights of {cfg.init_from})"
    if model_dir is None:
        tokenizer = "bundled byte tokenizer" if cfg.tokenizer is None else f"tokenizer {cfg.tokenizer}"
        return f"{cfg.model} (preset: random weights, seed {cfg.seed}; {tokenizer})"
    if str(model_dir) != cfg.model:
        return f"{cfg.model} ({model_dir})"
    return cfg.model


def _oom_message(error: BaseException, cfg: TrainConfig, step: int) -> str:
    """One line: what the device could not allocate, and how to see and fix what fits."""
    detail = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
    cap = f" --gpu-memory {cfg.gpu_memory}" if cfg.gpu_memory else ""
    return (
        f"GPU out of memory in step {step} ({detail}); see what fits with `slide plan --model {cfg.model} "
        f"--batch-size {cfg.batch_size} --seq-len {cfg.seq_len}{cap}`, then lower --batch-size or --seq-len, "
        "or use --block-slots 1"
    )


class _StopRequests:
    """Turns SIGINT/SIGTERM into a request to checkpoint and stop at the end of the current step.

    The handlers stay installed through the final checkpoint and the export, which polls ``requested``
    between shards; a second signal raises :class:`Interrupted` (a ``KeyboardInterrupt``) at once, and the
    run ends with exit status 128 + that signal's number (143 for a second SIGTERM, 130 for a SIGINT).
    Otherwise the run ends with :class:`RunStopped` (128 + the signal number) after what it needs to
    continue is saved.

    Note [Stop on every rank]: with data parallel a signal may reach one rank only (a scheduler, a user's
    ``kill``), and a rank that checkpointed and left alone would leave the others waiting in their next
    collective. So each rank adds its own requests (:meth:`local_flags`) to the host sum every step
    already makes (the step's real tokens, in ``_Trainer._log_step``), and every rank stops after the
    step in which any rank's signal was summed (:meth:`agree`): the same step everywhere, with no
    collective of its own. A signal that comes after the sum is summed at the next step. With no ``others``
    (a world of one) there is no one to agree with: a signal is agreed as it comes. Tested by
    ``test_sigterm_to_one_rank_checkpoints_every_rank``."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self, others: int = 0) -> None:
        self.requested: str | None = None
        self.agreed: str | None = None
        """The signal some rank had seen by the last step's sum (Note [Stop on every rank])."""
        self._alone = others == 0
        self._previous: dict[int, Any] = {}

    @property
    def exit_code(self) -> int:
        return 128 + signal.Signals[self.requested or self.agreed or "SIGINT"].value

    def local_flags(self) -> list[int]:
        """This rank's signals as counts to sum over the ranks, one per name of :attr:`SIGNALS`."""
        return [int(self.requested == name) for name in self.SIGNALS]

    def agree(self, summed: list[int]) -> None:
        """Take the ranks' summed :meth:`local_flags`: once any rank saw a signal, every rank stops."""
        if self.agreed is None and any(summed):
            self.agreed = self.SIGNALS[1] if summed[1] else self.SIGNALS[0]

    def stopped(self, when: str, output: Path) -> RunStopped:
        """The stop to raise: what happened and the command that continues the run."""
        name = self.requested or self.agreed
        return RunStopped(f"stopped by {name} {when}; continue with `{train_call(resume=output)}`", self.exit_code)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None:  # a second signal: stop now
            name = signal.Signals(signum).name
            raise Interrupted(name, 128 + signum)
        self.requested = signal.Signals(signum).name
        if self._alone:
            self.agreed = self.requested

    def __enter__(self) -> _StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def _resume(
    found: Path,
    state: dict[str, Any],
    engine: Engine,
    batches: Batches,
    run_state: dict[str, Any],
    run_dir: RunDir,
    group: RunGroup,
) -> int:
    """Load checkpoint ``found`` (``state``: its verified state.json, from :func:`checkpoint_to_resume`)
    into the running engine; return the step to continue from.

    Its run state is validated before any array moves (slide_hf/resume.py); a checkpoint older than the
    run's newest sets the later ones aside, so the next ``--resume`` continues this line. With data
    parallel each rank reads its own shards out of the step directory, whatever the number of processes
    that wrote it (slide_core/checkpoint/reader.py): a run resumes on more or fewer ranks, or on one."""
    allow = bool(run_state["config"].get("allow_data_change"))
    point = resume_point(
        found, state, model=run_state["model"], data_size=len(batches.dataset), allow_data_change=allow
    )
    saved_ranks = state["world_size"]
    world_size = group.world_size
    if saved_ranks != world_size and group.rank == 0:
        log.info(
            "resuming a checkpoint of %d process(es) on %d: each reads its shards from theirs", saved_ranks, world_size
        )
    try:
        engine.restore_checkpoint(found)
    except CheckpointCorrupt as error:
        raise UserError(corrupt_message(error)) from None
    except StateFormatMismatch as error:
        raise UserError(str(error)) from None
    engine.restore_schedule_state(point.engine)
    batches.position = DataPosition(point.epoch, point.index)
    torch.set_rng_state(point.rng)
    # Every rank has read the checkpoint before rank 0 moves later ones aside.
    group.barrier(f"the wait for every rank to load {found.name}", slow=True)
    if group.rank == 0:
        aside = run_dir.roll_back(found)
        if aside is not None:  # the abandoned line's weights-only saves go with its checkpoints
            set_aside_weights(run_dir.path, point.step, aside)
    log.info("resumed from %s at step %d", found, point.step)
    return point.step


def _overall_overlap(times: dict[str, Any]) -> float | None:
    """T_bwd / (T_d2h + T_update) over the step's units: >= 1 when transfers and updates hide entirely."""
    busy = sum(t.ms["backward"] + t.ms["head"] for t in times.values())
    cost = sum(t.ms["d2h"] + t.ms["update"] for t in times.values())
    return busy / cost if cost > 0 and busy > 0 else None


def _save_tokenizer(tokenizer: Any, config: Any, output: Path, model_dir: Path | None) -> Path:
    """Write what `slide export` needs beside the checkpoints: ``config/`` and ``tokenizer/``, the latter
    with the model's ``generation_config.json`` (a preset's is made from the tokenizer's special tokens),
    which the export copies along. A full disk is one line."""
    from transformers import GenerationConfig

    target = output / "tokenizer"
    source = None if model_dir is None else Path(model_dir) / "generation_config.json"
    try:
        target.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(target))
        if source is not None and source.is_file():
            shutil.copyfile(source, target / source.name)
        elif model_dir is None:
            ids = {k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
            GenerationConfig(**ids).save_pretrained(str(target))
        config.save_pretrained(str(output / "config"))
    except OSError as error:
        raise UserError(f"cannot write the tokenizer and config to {output}: {error.strerror or error}") from None
    return target
