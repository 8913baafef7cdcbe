"""The training recipe behind `slide train`: setup in dependency order, then one loop.

Read top to bottom: resolve the model and tokenizer, load the data, build units, pick the device, check
the plan fits, fill the fp32 master (checkpoint, HF weights or random init), then loop over optimizer
steps (LR, forward/backward with accumulation, step, logging, checkpoint, termination) and export an HF
directory at the end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from slide_core import AdamWConfig, HostParameters, LRSchedule
from slide_core.checkpoint import (
    CheckpointCorrupt,
    CheckpointWriteError,
    prune_checkpoints,
    save_checkpoint,
)
from slide_core.device import Device
from slide_core.engine import Engine, EngineConfig, EngineError
from slide_core.optim import TorchAdamW
from slide_hf.data import Batches, DataOptions, DataPosition, eval_batches, load_dataset, load_split
from slide_hf.errors import RunStopped, UserError
from slide_hf.export import use_tokenizer_special_tokens
from slide_hf.offload import offloaded_units, open_activation_tier, open_nvme_tier
from slide_hf.options import TrainConfig, config_dict
from slide_hf.progress import Progress
from slide_hf.resume import checkpoint_to_resume, corrupt_message, resume_point
from slide_hf.run_dir import RunDir, default_output, run_of
from slide_hf.run_export import export_run_model
from slide_hf.run_log import RunLog
from slide_hf.sizes import parse_size
from slide_hf.tokenizer import BYTE_VOCAB_SIZE, load_tokenizer

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
    output = cfg.output or (run_of(cfg.resume) if cfg.resume is not None else default_output())
    with RunDir(output, resume_from=cfg.resume, overwrite=cfg.overwrite) as run_dir:
        return _train(cfg, run_dir, on_step=on_step, on_eval=on_eval)


def _train(
    cfg: TrainConfig,
    run_dir: RunDir,
    *,
    on_step: Callable[[dict[str, Any]], None] | None,
    on_eval: Callable[[dict[str, Any]], None] | None,
) -> TrainSummary:
    torch.manual_seed(cfg.seed)
    output = run_dir.path

    # Model and tokenizer.
    from slide_hf import init_random, load_weights
    from slide_hf.adapters import attention_summary

    config, model_dir, tokenizer, model = _setup_model(cfg)
    if model_dir is None:  # a preset trains with the bundled tokenizer: its exports carry that tokenizer's ids
        use_tokenizer_special_tokens(config, tokenizer)

    # Data.
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    data_options = DataOptions(
        seq_len=cfg.seq_len,
        packing=cfg.packing,
        train_on_inputs=cfg.train_on_inputs,
        chat_template=cfg.chat_template,
        max_positions=max_positions,
        vocab_size=config.vocab_size,
    )
    dataset, eval_set = _load_data(cfg, tokenizer, data_options, output / DATA_CACHE)
    batches = Batches(dataset, cfg.batch_size, cfg.grad_accum, shuffle=not cfg.no_shuffle, seed=cfg.seed)
    epochs = cfg.epochs or (10 if cfg.data is None else 1)
    total_steps = cfg.steps or epochs * batches.steps_per_epoch
    lr = cfg.lr if cfg.lr is not None else (1e-3 if model_dir is None else 2e-5)
    schedule = LRSchedule(lr, cfg.lr_schedule, cfg.warmup_steps, total_steps)
    adam = AdamWConfig(cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, cfg.weight_decay)

    # Plan: refuse what cannot fit before allocating anything; spend spare GPU memory on resident units.
    for flag, value in (
        ("--offload-optimizer", cfg.offload_optimizer),
        ("--offload-activations", cfg.offload_activations),
    ):
        if value == "nvme" and cfg.nvme_dir is None:
            raise UserError(f"{flag} nvme needs --nvme-dir PATH (a directory on a fast local disk)")
    device = _make_device(cfg)
    compute_dtype = DTYPES[cfg.dtype]
    resident = _plan_and_place(cfg, model, device, compute_dtype)
    run_log = RunLog(
        output,
        config_dict(cfg),
        metrics=cfg.metrics,
        report_to=cfg.report_to,
        inputs=tuple(p for p in (cfg.data, cfg.eval_data, cfg.resume) if isinstance(p, Path)),
    )
    with device, run_log:
        host = HostParameters(model)  # the engine pins what it streams and gives back what lives on the GPU
        if model_dir is None:
            init_random(model, host, config, seed=cfg.seed)
        else:
            try:
                load_weights(model, host, model_dir)
            except ValueError as error:  # CheckpointError, ModelFilesError: one line naming file and tensor
                raise UserError(str(error)) from None
        params = sum(unit.layout.param_numel for unit in model.units)
        flops_per_token = _flops_per_token(config, params, cfg.seq_len)
        log.info(
            "model %s: %.1fM params, %d blocks | data: %s, %d sequences of %d tokens | %d steps of %d tokens | "
            "device %s (%s)",
            _describe_model(cfg, model_dir),
            params / 1e6,
            len(model.blocks),
            dataset.source,
            len(dataset),
            cfg.seq_len,
            total_steps,
            cfg.batch_size * cfg.grad_accum * cfg.seq_len,
            device.facts().name,
            cfg.dtype,
        )
        log.info("attention: %s", attention_summary(model, device.torch_device.type, compute_dtype))
        offloaded = offloaded_units(model, cfg.nvme_fraction, resident) if cfg.offload_optimizer == "nvme" else ()
        engine_config = EngineConfig(
            block_slots=cfg.block_slots,
            compute_dtype=compute_dtype,
            resident_units=resident,
            offloaded_units=offloaded,
            max_grad_norm=cfg.max_grad_norm,
            # With several micro-batches the final gradient exists only on the host, and its norm would make
            # every step wait for the whole host update (see EngineConfig.report_grad_norm); clipping needs
            # the norm anyway.
            report_grad_norm=cfg.grad_accum == 1 or cfg.max_grad_norm > 0,
        )
        if resident:
            log.info("device-resident units (master + Adam state on the GPU): %s", ", ".join(resident))
        state_tier = open_nvme_tier(run_dir.scratch(cfg.nvme_dir)) if offloaded else None
        if offloaded:
            log.info("Adam state on NVMe (%s) for %d units", cfg.nvme_dir, len(offloaded))
        activation_tier = (
            open_activation_tier(run_dir.scratch(cfg.nvme_dir), device) if cfg.offload_activations == "nvme" else None
        )
        if activation_tier is not None:
            log.info("block inputs on the %s tier in %s", activation_tier.name, cfg.nvme_dir)
        engine = Engine(
            model,
            device,
            host,
            _host_optimizer(adam),
            engine_config,
            state_tier=state_tier,
            activation_tier=activation_tier,
        )
        checkpoints = output / "checkpoints"
        # What `slide export` needs to turn any checkpoint of this run into an HF directory.
        tokenizer_dir = _save_tokenizer(tokenizer, config, output, model_dir)
        run_state = {"model": cfg.model, "seed": cfg.seed, "total_steps": total_steps, "config": config_dict(cfg)}
        losses: list[float] = []
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        process = psutil.Process()
        stop = _StopRequests()

        evaluator = _Evaluator(engine, eval_set, cfg.batch_size) if eval_set is not None else None
        best: dict[str, Any] = {}

        def evaluate(step: int) -> None:
            """Eval loss at ``step``; with --save-best, a new best is checkpointed and kept from pruning."""
            nonlocal last_saved
            record = evaluator.run(step)
            progress.evaluation(record)
            run_log.record(record)
            if on_eval is not None:
                on_eval(dict(record))
            if cfg.save_best and record["eval_loss"] < best.get("eval_loss", math.inf):
                if last_saved != step:
                    last_saved = checkpoint(step, protect_step=step)
                best.update(step=step, eval_loss=record["eval_loss"], path=str(_checkpoint_path(checkpoints, step)))
                _write_best(checkpoints, best)
                log.info("best eval loss so far: %.4f at step %d (%s)", record["eval_loss"], step, best["path"])

        def checkpoint(step: int, protect_step: int | None = None) -> int:
            arrays = engine.checkpoint_arrays()  # note: waits for every pending update (a host sync), only when saving
            state = {**run_state, "data": {"epoch": batches.position.epoch, "index": batches.position.index}}
            state["rng"] = torch.get_rng_state().tolist()
            state["engine"] = engine.schedule_state()
            try:
                saved = save_checkpoint(checkpoints, step, arrays, state)
            except CheckpointWriteError as error:
                raise UserError(error.strerror) from error
            keep_best = [Path(best["path"])] if best else []
            if protect_step is not None:
                keep_best.append(saved)
            prune_checkpoints(checkpoints, cfg.keep_checkpoints, protect=keep_best)
            log.info("checkpoint written to %s", saved)
            return step

        with stop, contextlib.ExitStack() as tiers, engine:
            for tier in (state_tier, activation_tier):
                if tier is not None:
                    tiers.callback(tier.close)
            # Inside the running engine: each unit's arrays stream to where the unit lives.
            first_step = _resume(cfg.resume, engine, batches, run_state, run_dir) if cfg.resume is not None else 0
            last_saved = first_step if cfg.resume is not None else None
            best.update(_read_best(checkpoints) if cfg.resume is not None and cfg.save_best else {})
            run_log.start(first_step)
            device.reset_peak_memory()
            has_gpu = device.torch_device.type != "cpu"
            progress = Progress(total_steps, first_step=first_step, has_gpu=has_gpu, log_every=cfg.log_every)
            with progress:
                for step in range(first_step, total_steps):
                    # LR for this step, then forward/backward over its micro-batches and the update.
                    try:
                        micro_batches = batches.next_step()
                        result = engine.step(micro_batches, lr=schedule.lr_at(step))
                    except torch.OutOfMemoryError as error:
                        raise UserError(_oom_message(error, cfg, step + 1)) from error
                    except EngineError as error:
                        raise UserError(str(error)) from error
                    if result.skipped:
                        log.warning("step %d skipped exactly: non-finite gradients (nothing applied)", step + 1)
                    elif not math.isfinite(result.loss):
                        raise UserError(f"the loss became {result.loss} at step {result.step}; try a lower --lr")
                    else:
                        losses.append(result.loss)
                    # Logging.
                    times = engine.unit_times()
                    real_tokens = _real_tokens(micro_batches, pad_id)
                    record = {
                        "step": result.step,
                        "loss": result.loss,
                        "lr": result.lr,
                        "tokens": real_tokens,
                        "loss_tokens": result.loss_tokens,
                        "padded_tokens": result.tokens,
                        "tokens_per_s": real_tokens / result.wall_s,
                        "step_time_s": result.wall_s,
                        "tflops": flops_per_token * result.tokens / result.wall_s / 1e12,  # padding is computed too
                        "overlap": _overall_overlap(times),
                        "grad_norm": result.grad_norm,
                        "skipped": result.skipped,
                        "gpu_mem_peak_gb": device.peak_memory_bytes() / 1e9,
                        "host_rss_gb": process.memory_info().rss / 1e9,
                    }
                    progress.update(record)  # adds the time remaining, eta_s
                    run_log.record(record)
                    if on_step is not None:
                        on_step(dict(record))
                    # Evaluation: every --eval-every steps, and after the last step.
                    done = step + 1
                    if evaluator is not None and (
                        done == total_steps or (cfg.eval_every and done % cfg.eval_every == 0)
                    ):
                        evaluate(done)
                    # Checkpoint: every --save-every steps, and when asked to stop (SIGINT/SIGTERM).
                    if (cfg.save_every and done % cfg.save_every == 0) or stop.requested:
                        last_saved = checkpoint(done)
                    if stop.requested:
                        raise stop.stopped(f"after step {done}; its checkpoint is saved", output)
            # Training is over. The final state is checkpointed first, whatever --save-every says, so the
            # export below can fail (full disk, a signal) without losing the run.
            final_step = max(first_step, total_steps)
            if last_saved != final_step:
                checkpoint(final_step)
            if stop.requested:
                raise stop.stopped(f"after step {final_step}; its checkpoint is saved", output)
            # Free the host Adam state before the GPU-resident masters come back for the export, so the
            # host never holds both (Note [Resident host copies] in slide_core's engine).
            engine.close(keep_host_state=False)
            # Export: an HF directory next to the run's other outputs, still under the signal handlers.
            save_dtype = None if cfg.save_dtype == "auto" else DTYPES[cfg.save_dtype]
            model_out = export_run_model(
                model, host, config, output, final_step, dtype=save_dtype, tokenizer_dir=tokenizer_dir, stop=stop
            )
    if first_step >= total_steps:  # a finished run, resumed: its model is written again, nothing to train
        log.info(
            "the run in %s had reached step %d: nothing left to train; model written to %s",
            output,
            first_step,
            model_out,
        )
        return TrainSummary(0, math.nan, math.nan, output, model_out, [])
    if not losses:  # every step was skipped (non-finite gradients)
        raise UserError(f"no optimizer step was applied; the model was still written to {model_out}")
    log.info("loss %.4f -> %.4f over %d steps; model written to %s", losses[0], losses[-1], len(losses), model_out)
    return TrainSummary(len(losses), losses[0], losses[-1], output, model_out, losses)


DATA_CACHE = ".data-cache"
"""Prepared rows, cached inside the run directory: a restart or resume reads them instead of re-tokenizing."""


def _load_data(cfg: TrainConfig, tokenizer: Any, options: DataOptions, cache_dir: Path) -> tuple[Any, Any]:
    """``(train rows, eval rows or None)``: --eval-fraction holds out whole examples of --data before
    packing, so no document is in both; --eval-data is prepared with the same options."""
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
    per engine call so host memory stays small on a large eval set; nothing of the optimizer is touched."""

    GROUP = 64

    def __init__(self, engine: Engine, rows: Any, batch_size: int) -> None:
        self.engine, self.rows, self.batch_size = engine, rows, batch_size

    def run(self, step: int) -> dict[str, Any]:
        began = time.perf_counter()
        loss_sum, loss_tokens = 0.0, 0
        group: list[Any] = []
        for micro_batch in eval_batches(self.rows, self.batch_size):
            group.append(micro_batch)
            if len(group) == self.GROUP:
                loss_sum, loss_tokens = self._add(group, loss_sum, loss_tokens)
                group = []
        if group:
            loss_sum, loss_tokens = self._add(group, loss_sum, loss_tokens)
        loss = loss_sum / loss_tokens if loss_tokens else math.nan
        return {
            "step": step,
            "eval_loss": loss,
            "perplexity": math.exp(min(loss, 700.0)),
            "eval_loss_tokens": loss_tokens,
            "eval_time_s": time.perf_counter() - began,
        }

    def _add(self, group: list[Any], loss_sum: float, loss_tokens: int) -> tuple[float, int]:
        try:
            result = self.engine.evaluate(group)
        except EngineError as error:
            raise UserError(str(error)) from error
        return loss_sum + result.loss_sum, loss_tokens + result.loss_tokens


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


def _read_best(checkpoints: Path) -> dict[str, Any]:
    try:
        best = json.loads((checkpoints / "best.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    fields_ok = isinstance(best, dict) and isinstance(best.get("eval_loss"), int | float) and "path" in best
    return best if fields_ok and Path(best["path"]).is_dir() else {}


def _setup_model(cfg: TrainConfig) -> tuple[Any, Path | None, Any, Any]:
    """``(config, model_dir, tokenizer, model)``: a model directory, a Hub id (cached first) or a preset."""
    from slide_hf import build_model, resolve_model
    from slide_hf.hub import is_hub_id, resolve_hub_model
    from slide_hf.presets import PRESETS

    source: str | Path = cfg.model
    if cfg.model not in PRESETS and is_hub_id(cfg.model):
        source = resolve_hub_model(cfg.model)
    preset_overrides = {"vocab_size": BYTE_VOCAB_SIZE} if cfg.model == "tiny-llama" else {}
    try:
        config, model_dir = resolve_model(source, **preset_overrides)
    except ValueError as error:
        raise UserError(str(error)) from error
    tokenizer = load_tokenizer(model_dir, cfg.tokenizer)
    if len(tokenizer) > config.vocab_size:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but the model only {config.vocab_size}")
    try:
        model = build_model(config)
    except ValueError as error:
        raise UserError(str(error)) from error
    return config, model_dir, tokenizer, model


def _describe_model(cfg: TrainConfig, model_dir: Path | None) -> str:
    """How the first log line names the model. A preset says ``random weights`` there: a run on a preset
    must never pass for a fine-tune of real weights in anyone's log."""
    if model_dir is None:
        tokenizer = "bundled byte tokenizer" if cfg.tokenizer is None else f"tokenizer {cfg.tokenizer}"
        return f"{cfg.model} (preset: random weights, seed {cfg.seed}; {tokenizer})"
    if str(model_dir) != cfg.model:
        return f"{cfg.model} ({model_dir})"
    return cfg.model


def _plan_and_place(cfg: TrainConfig, model: Any, device: Device, compute_dtype: torch.dtype) -> tuple[str, ...]:
    """Check the run fits (host RAM, GPU budget) and choose the units to keep on the GPU."""
    from slide_hf.planner import (
        PlanInputs,
        available_host_bytes,
        check_fits,
        device_gpu_budget,
        make_plan,
        plan_with_placement,
    )

    gpu_budget = device_gpu_budget(device)
    inputs = PlanInputs(
        model,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        grad_accum=cfg.grad_accum,
        compute_dtype_bytes=torch.empty((), dtype=compute_dtype).element_size(),
        block_slots=cfg.block_slots,
        gpu_memory_bytes=gpu_budget,
        clipping=cfg.max_grad_norm > 0,
        offload_optimizer=cfg.offload_optimizer,
        nvme_fraction=cfg.nvme_fraction,
        offload_activations=cfg.offload_activations,
    )
    check_fits(make_plan(inputs), host_available=available_host_bytes(), gpu_available=gpu_budget)
    return plan_with_placement(inputs).inputs.resident_units


def _oom_message(error: BaseException, cfg: TrainConfig, step: int) -> str:
    """One line: what the device could not allocate, and how to see and fix what fits."""
    detail = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
    cap = f" --gpu-memory {cfg.gpu_memory}" if cfg.gpu_memory else ""
    return (
        f"GPU out of memory in step {step} ({detail}); see what fits with `slide plan --model {cfg.model} "
        f"--batch-size {cfg.batch_size} --seq-len {cfg.seq_len}{cap}`, then lower --batch-size or --seq-len, "
        "or use --block-slots 1"
    )


def _host_optimizer(adam: AdamWConfig) -> Any:
    """The fused one-pass CPU AdamW when numba is installed; torch's fused AdamW + casts otherwise."""
    try:
        from slide_core.optim.fused_adamw import best_adamw
    except ImportError:
        return TorchAdamW(adam)
    return best_adamw(adam)


class _StopRequests:
    """Turns SIGINT/SIGTERM into a request to checkpoint and stop at the end of the current step.

    The handlers stay installed through the final checkpoint and the export, which polls ``requested``
    between shards; a second signal raises ``KeyboardInterrupt`` at once. Either way the run ends with
    :class:`RunStopped` (exit status 128 + the signal number) after what it needs to continue is saved."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def exit_code(self) -> int:
        return 128 + signal.Signals[self.requested or "SIGINT"].value

    def stopped(self, when: str, output: Path) -> RunStopped:
        """The stop to raise: what happened and the command that continues the run."""
        return RunStopped(
            f"stopped by {self.requested} {when}; continue with `slide train --resume {output}`", self.exit_code
        )

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __enter__(self) -> _StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def _resume(path: Path, engine: Engine, batches: Batches, run_state: dict[str, Any], run_dir: RunDir) -> int:
    """Load the newest checkpoint at ``path`` into the running engine; return the step to continue from.

    Its run state is validated before any array moves (slide_hf/resume.py); a checkpoint older than the
    run's newest sets the later ones aside, so the next ``--resume`` continues this line."""
    found, state = checkpoint_to_resume(path)
    point = resume_point(found, state, model=run_state["model"], data_size=len(batches.dataset))
    try:
        engine.restore_checkpoint(found)
    except CheckpointCorrupt as error:
        raise UserError(corrupt_message(error)) from None
    engine.restore_schedule_state(point.engine)
    batches.position = DataPosition(point.epoch, point.index)
    torch.set_rng_state(point.rng)
    run_dir.roll_back(found)
    log.info("resumed from %s at step %d", found, point.step)
    return point.step


def _make_device(cfg: TrainConfig) -> Device:
    from slide_core.devices.cpu import CPUDevice

    wants_gpu = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if not wants_gpu:
        if cfg.gpu_memory is not None:
            log.warning("--gpu-memory is ignored on the CPU device")
        return CPUDevice()
    if not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but torch sees no GPU; use --device auto or cpu")
    limit = parse_size(cfg.gpu_memory, what="--gpu-memory") if cfg.gpu_memory else None
    if torch.version.hip:
        from slide_core import plugins

        try:
            rocm = plugins.load("slide.devices", "rocm")
        except plugins.PluginError as error:
            raise UserError(str(error)) from error
        return rocm(memory_limit_bytes=limit)
    from slide_core.devices.cuda import CUDADevice

    return CUDADevice(memory_limit_bytes=limit)


def _flops_per_token(config: Any, params: int, seq_len: int) -> float:
    """Model FLOPs per token: 6N for the matmuls plus 12·L·H·S for attention scores (fwd+bwd);
    the recompute forward is not counted, so TFLOPS compares fairly with a run that keeps activations."""
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    return 6.0 * params + 12.0 * layers * hidden * seq_len


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
