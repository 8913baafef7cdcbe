"""`slide plan`: GPU, host and disk memory, max batch and step time for a model, before any allocation.

Planning builds the model on the meta device (no weights), so it runs in seconds for any size, on any
machine. Without ``--gpu-memory`` the GPU budget is the memory of the ``--device`` this machine would train
on (none for the CPU device); without ``--host-memory`` the host budget is this machine's available RAM.
``--device``, ``--offload-optimizer`` and ``--optimizer`` take the names `slide train` takes (the installed
entry points); a tier that keeps files is planned as disk, any other as host RAM. A configuration that
does not fit is still reported (exit 0), with the fix to try; ``--check`` turns that into exit status 2.

Step times divide by this machine's rates as `slide doctor` measured and cached them, else by the documented
defaults (slide_hf/machine_rates.py); the plan says which. ``--update-placement`` places units as `slide train`
would (host-updated, updated on the GPU as they stream, or resident), and the plan lists how many of each and
each resource's time per step (the step takes the largest).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slide_hf.defaults import model_positions, resolve_seq_len
from slide_hf.errors import UserError
from slide_hf.planner import (
    Plan,
    PlanInputs,
    available_host_bytes,
    check_fits,
    format_bytes,
    make_plan,
    parse_size,
    plan_with_placement,
)
from slide_hf.planner.attention_masks import attention_masks
from slide_hf.planner.plan import check_update_placement
from slide_hf.planner.save_cost import SaveCost, save_cost
from slide_hf.planner.seq_fit import SequenceFit, sequence_fit
from slide_hf.sizes import SIZE_RULE
from slide_hf.spelling import option

if TYPE_CHECKING:
    from slide_hf.options import TrainConfig

__all__ = ["add_parser", "run"]

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
"""Bytes per element of each compute dtype (slide_hf.options.DType; its aliases are resolved before)."""

EPILOG = textwrap.dedent(
    """\
    examples:
      slide plan --model llama3.1-8b --batch-size 8 --seq-len 2048 --gpu-memory 24GiB
      slide plan --model ./my-qwen --offload-optimizer nvme --nvme-fraction 0.5 --json
      slide plan --model qwen2.5-14b --host-memory 128GB --check   # exit 2 if it does not fit

    """
)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    from slide_hf.options import add_options

    parser = subparsers.add_parser(
        "plan",
        help="memory and step-time plan for a model (no weights loaded)",
        description="Estimate GPU, host and disk memory, the largest batch that fits and the step time.",
        epilog=EPILOG + "\n" + SIZE_RULE + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(parser, "plan")  # the options it shares with `slide train`, as slide_hf/options/config.py declares
    add = parser.add_argument
    add("--host-memory", metavar="SIZE", help="host RAM budget (default: available RAM here)")
    add("--nnodes", type=int, default=1, help="data parallel: hosts (default 1)")
    add("--intra-gbps", type=float, default=150.0, help="data parallel: GB/s per GPU within a host (default 150)")
    add("--inter-gbps", type=float, default=25.0, help="data parallel: GB/s per GPU between hosts (default 25)")
    add("--json", action="store_true", help="print one JSON object instead of a table")
    add("--check", action="store_true", help="exit with status 2 when the plan does not fit")
    return parser


def run(args: argparse.Namespace) -> int:

    from slide_hf.offload import state_tier_class
    from slide_hf.setup import RunOptions, plan_inputs, unbuilt_optimizer

    cfg = _options(args)  # option errors first: building takes seconds
    state_tier_class(cfg.offload_optimizer)  # a tier that does not load is one line, before the model is built
    optimizer = _optimizer_class(cfg.optimizer)
    if cfg.optimizer_state != "fp32":  # compact moments are kept by CompactAdamW (slide_core's build_optimizer)
        optimizer = f"CompactAdamW ({'numba kernels' if optimizer == 'FusedAdamW' else 'torch ops'})"
    gpu_cap, gpu_source = _gpu_budget(None if cfg.gpu_memory is None else str(cfg.gpu_memory), cfg.device)
    accelerator = _plans_accelerator(cfg.device, gpu_cap)
    cfg = _with_dtype(cfg, args, accelerator)
    assert cfg.dtype is not None  # chosen as `slide train` chooses it where not given
    if not accelerator:
        if cfg.gpu_memory is not None:  # as `slide train` says it (slide_hf/setup.py)
            logging.getLogger("slide.plan").warning("%s is ignored on the CPU device", option("gpu_memory"))
        gpu_cap, gpu_source = None, "the CPU device: no GPU memory"
    if args.host_memory is not None:
        host_cap, host_source = parse_size(args.host_memory, what="--host-memory"), "allowed by --host-memory"
    else:
        host_cap, host_source = available_host_bytes(), "available"
    model = _build(cfg.model)
    from slide_hf.adapters.base import refuse_packing

    refuse_packing(model, packing=cfg.packing)  # as `slide train` refuses it, before its data
    seq_len = resolve_seq_len(cfg.seq_len, model.config)
    from slide_hf.machine_rates import planning_bandwidths
    from slide_hf.planner import Bandwidths

    bandwidths, rates_source = planning_bandwidths()
    if not accelerator:
        bandwidths, rates_source = Bandwidths(), "documented defaults (the CPU device)"
    options = RunOptions.from_config(cfg, seq_len=seq_len)
    inputs = plan_inputs(
        model,
        options,
        accelerator=accelerator,
        gpu_memory_bytes=gpu_cap,
        host_memory_bytes=host_cap,
        bandwidths=bandwidths,
        optimizer=unbuilt_optimizer(options),
    )
    from slide_hf.in_step_rates import checkpoint_write_gbps, learned_inputs, workload_key

    if accelerator:  # what earlier runs measured in their steps here (slide_hf/in_step_rates.py)
        inputs, learned = learned_inputs(inputs)
        if learned is not None:
            rates_source = f"{rates_source}; {learned}"
    plan = make_plan(inputs)
    sequences = sequence_fit(
        inputs, gpu_cap if accelerator else None, options.seq_tile, positions=model_positions(model.config)
    )
    distributed = args.nproc_per_node * args.nnodes > 1
    placement = cfg.update_placement.value
    check_update_placement(inputs, placement)  # as `slide train` refuses it, distributed or not
    if gpu_cap is None or plan.gpu_peak_bytes <= gpu_cap:
        # spare GPU memory holds whole units (master + Adam state), then the updates streamed to the GPU, and
        # the units a run may move between them, as each `slide train` rank places them
        plan = plan_with_placement(inputs, placement, replaceable=True)
    dp = _data_parallel(plan, args) if distributed else None
    outputs = _output_disk(model, cfg)
    saving = save_cost(
        outputs,
        background=cfg.save_async,
        host_peak_bytes=plan.host_peak_bytes,
        host_available=host_cap,
        bandwidths=plan.inputs.bandwidths,
        write_gbps=checkpoint_write_gbps(cfg.output or Path("runs")),  # where `slide train` writes by default
    )
    problem = _positions_problem(model, seq_len)
    try:
        check_fits(plan, host_available=host_cap, gpu_available=gpu_cap, gpu_source=gpu_source, host_source=host_source)
    except UserError as error:
        problem = problem or str(error)
    if cfg.output is not None:  # a disk the user named; the default's is this machine's, often not the run's
        problem = problem or _output_disk_problem(cfg.output, outputs)
    if args.json:
        payload = {"model": cfg.model, "dtype": cfg.dtype.value, **plan.to_dict(), "fits": problem is None}
        payload.update({"optimizer": optimizer, "optimizer_state": cfg.optimizer_state.value})
        payload.update({"master": inputs.master_format})
        payload.update({"state_tier": cfg.offload_optimizer, "output_disk": outputs.to_dict()})
        payload["checkpoint_save"] = None if outputs.export_only else saving.to_dict()
        payload.update({"problem": problem, "gpu_memory_source": gpu_source, "host_memory_source": host_source})
        payload.update({"update_placement": placement, "rates_source": rates_source})
        payload.update(sequences.to_dict())
        payload["attention_masks"] = attention_masks(plan.inputs).to_dict()
        payload["workload"] = workload_key(inputs)  # what a GPU rate measured in this run's steps is kept under
        payload["engine_config"] = engine_config_dict(plan.inputs.engine_config())
        payload["buffers"] = plan.buffers().to_dict()
        payload["placement"] = {where: list(names) for where, names in plan.placement_counts().items()}
        if dp is not None:
            payload["data_parallel"] = dp.to_dict()
        if not accelerator:  # no compute rate to plan a step with: nothing made up (see render)
            payload.update(dict.fromkeys(UNTIMED_ON_CPU))
        print(json.dumps(json_numbers(payload), sort_keys=False, allow_nan=False))
    else:
        text = render(
            plan,
            model_name=cfg.model,
            dtype=cfg.dtype.value,
            gpu_source=gpu_source,
            problem=problem,
            optimizer=f"{optimizer}, {_state_words(cfg.optimizer_state)}Adam state on {cfg.offload_optimizer}, "
            f"{inputs.master_format} master",
            outputs=outputs,
            saving=saving,
            update_placement=placement,
            rates_source=rates_source,
            sequences=sequences,
        )
        print(text)
        if dp is not None:
            from slide_hf.planner.distributed import render_data_parallel

            print(render_data_parallel(dp))
    if problem is not None and args.check:
        raise UserError(problem)
    return 0


SLOWEST_LINK_GBPS = 0.001
"""The slowest ``--intra-gbps``/``--inter-gbps`` planned (1 MB/s): no GPU link is slower, and a rate near
zero (1e-320 parses as a positive float) only times a step at infinity."""

UNTIMED_ON_CPU = (
    "compute_s",
    "pcie_s",
    "update_s",
    "disk_s",
    "step_time_s",
    "clipped_step_time_s",
    "reference_step_s",
    "resource_bound_s",
    "tokens_per_s",
    "overlap",
    "binding",
    "critical_batch_size",
    "resource_s",
)
"""The plan's timing keys, null on the CPU device: the planner has no CPU compute rate, so a step time there
would be a GPU's at the documented default rates, tens of times faster than the CPU runs (`slide train`
logs only the host peak there, and measures its steps)."""


def json_numbers(value: Any) -> Any:
    """``value`` with every non-finite float as None: ``json.dumps`` would write ``Infinity`` or ``NaN``,
    which is not JSON (jq and strict parsers refuse it). An infinite overlap (nothing to hide behind the
    backward) or a step no budget can time has no number."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_numbers(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_numbers(item) for item in value]
    return value


def _data_parallel(plan: Plan, args: argparse.Namespace) -> Any:
    """The plan of ``--nproc-per-node`` x ``--nnodes`` ranks, each at ``plan``'s per-rank batch."""
    from slide_hf.planner.distributed import Interconnect, plan_data_parallel

    link = Interconnect(intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps)
    return plan_data_parallel(plan, args.nproc_per_node, args.nnodes, link)


def _options(args: argparse.Namespace) -> TrainConfig:
    """The options `slide plan` shares with `slide train`, refused by the same rules (each value, then every
    cross-option rule for the planned number of processes); then the plan's own numbers."""
    from slide_hf.options import TrainConfig, given_options

    for flag, value in (("--nproc-per-node", args.nproc_per_node), ("--nnodes", args.nnodes)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    cfg = TrainConfig.for_command("plan", args.nproc_per_node * args.nnodes, **given_options(args, "plan"))
    for flag, value in (("--intra-gbps", args.intra_gbps), ("--inter-gbps", args.inter_gbps)):
        if not (math.isfinite(value) and value >= SLOWEST_LINK_GBPS):
            raise UserError(f"{flag} must be a finite number >= {SLOWEST_LINK_GBPS:g} (GB/s), got {value}")
    return cfg


def _with_dtype(cfg: TrainConfig, args: argparse.Namespace, accelerator: bool) -> TrainConfig:
    """``cfg``, with the compute dtype `slide train` takes on the planned device where ``--dtype`` was not
    given (slide_hf/device_defaults.py: fp32 on a CPU without native bf16), so the plan prices that run."""
    if cfg.dtype is not None:
        return cfg
    from slide_hf.device_defaults import default_compute_dtype
    from slide_hf.options import TrainConfig, given_options

    chosen = default_compute_dtype(accelerator, cfg.master).dtype
    values = {**given_options(args, "plan"), "dtype": chosen}
    return TrainConfig.for_command("plan", args.nproc_per_node * args.nnodes, **values)


def _output_disk(model: Any, cfg: TrainConfig) -> Any:
    """The checkpoints and export of a `slide train` run of ``model`` with these options, priced by what
    writes them (slide_hf/planner/output_disk.py)."""
    import torch

    from slide_core.optim.state_formats import state_arrays
    from slide_hf.export import resolve_dtype
    from slide_hf.planner.output_disk import run_output_disk

    export_dtype = resolve_dtype(None if cfg.save_dtype == "auto" else cfg.save_dtype.value, model.config)
    return run_output_disk(  # the checkpoint options as `slide train` prices them (recipe.py)
        cfg,
        [unit.layout.numel for unit in model.units],
        state_arrays(cfg.optimizer_state.value),
        params=sum(unit.layout.param_numel for unit in model.units),
        export_itemsize=torch.empty((), dtype=export_dtype).element_size(),
    )


def _output_disk_problem(directory: Path, outputs: Any) -> str | None:
    """What `slide train` would refuse of its output directory before its first step: a file where the
    directory should be (an option error here too), or a disk that cannot hold one checkpoint and the export
    (the plan then does not fit). ``directory``: ``--output``. Without it the disk is not checked: a plan made
    here is often of a run on another machine, and this machine's ``runs/`` says nothing of that one's."""
    from slide_hf.planner.output_disk import check_output_disk

    if directory.exists() and not directory.is_dir():
        raise UserError(f"{option('output', directory)} is a file, not a directory")
    try:
        check_output_disk(directory, outputs)
    except UserError as error:
        return str(error)
    return None


def _state_words(optimizer_state: str) -> str:
    """``"bf16 "`` before "Adam state" for a compact format; nothing for the default fp32."""
    return "" if optimizer_state == "fp32" else f"{optimizer_state} "


def engine_config_dict(config: Any) -> dict[str, Any]:
    """An :class:`~slide_core.engine.EngineConfig` as JSON: every field, the compute dtype by name and the
    unit lists as lists, so `slide plan --json` and a run's config compare as equal values."""
    import dataclasses

    values = dataclasses.asdict(config)
    values["compute_dtype"] = str(config.compute_dtype).removeprefix("torch.")
    return {name: list(value) if isinstance(value, tuple) else value for name, value in values.items()}


def _plans_accelerator(device_name: str, gpu_cap: int | None) -> bool:
    """Whether the planned run computes on a GPU: `slide train` would on a ``--device`` other than cpu
    (``auto`` where this machine has a GPU, or where ``--gpu-memory`` says the plan is for one)."""
    if device_name == "cpu":
        return False
    if device_name == "auto":
        from slide_core.devices import auto_device_name

        return gpu_cap is not None or auto_device_name() != "cpu"
    return True


def _optimizer_class(name: str) -> str:
    """The class ``--optimizer name`` trains with here (``auto``: as `slide train` decides, without compiling
    anything); a plugin that is not an optimizer is one line."""
    from slide_core import Optimizer, plugins
    from slide_core.optim import AUTO, auto_optimizer_name

    if name == AUTO:
        name = auto_optimizer_name()
    try:
        return str(plugins.load("slide.optimizers", name, expected=Optimizer).__name__)
    except plugins.PluginError as error:
        raise UserError(f"--optimizer {name}: {error}") from None


def _positions_problem(model: Any, seq_len: int) -> str | None:
    """`slide train` refuses a --seq-len past the model's positions, so the plan must not say it fits."""
    positions = model_positions(model.config)
    if positions is not None and seq_len > positions:
        return f"--seq-len {seq_len} exceeds the model's {positions} positions"
    return None


def _build(name: str) -> Any:
    """The meta-device model for a directory or preset; every failure becomes one :class:`UserError` line."""
    from slide_hf import build_model, resolve_model
    from slide_hf.presets import run_overrides

    try:
        config, _ = resolve_model(name, **run_overrides(name))
        return build_model(config)
    except (ValueError, OSError) as error:  # ModelNotFoundError, UnsupportedModelError, unreadable config
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(message) from error


def _gpu_budget(text: str | None, device_name: str) -> tuple[int | None, str]:
    """``--gpu-memory``, else the whole memory of the ``--device`` plugin here (built, never opened)."""
    if text is not None:
        return parse_size(text, what="--gpu-memory"), "allowed by --gpu-memory"
    from slide_hf.setup import make_device

    device = make_device(device_name)
    if device.is_accelerator:
        facts = device.facts()
        return facts.total_memory_bytes, f"on {facts.name}"
    return None, "no GPU visible; pass --gpu-memory"


def render(
    plan: Plan,
    *,
    model_name: str,
    dtype: str,
    gpu_source: str,
    problem: str | None,
    optimizer: str | None = None,
    outputs: Any = None,
    saving: SaveCost | None = None,
    update_placement: str | None = None,
    rates_source: str | None = None,
    sequences: SequenceFit | None = None,
) -> str:
    """The human-readable table; ``optimizer`` says which host optimizer and state tier were planned,
    ``outputs`` (an ``OutputDisk``) what the run's checkpoints and export take, ``saving`` what one of
    those checkpoints costs the loop (slide_hf/planner/save_cost.py), ``update_placement`` the
    ``--update-placement`` the units were placed by, ``rates_source`` where the step time's rates came from
    and ``sequences`` how long a sequence the GPU budget holds."""
    i = plan.inputs
    lines = [
        f"{model_name}: {_count(plan.params)} params, batch {i.batch_size} x seq {i.seq_len} x accum "
        f"{i.grad_accum} = {plan.tokens_per_step:,} tokens/step, {dtype}",
    ]
    if not i.fused_loss:
        lines.append("(slide-kernels is not installed here: the head's logits are counted in full)")
    if i.accelerator:
        lines += ["", _row("GPU peak", format_bytes(plan.gpu_peak_bytes), f"largest phase: {plan.gpu_peak_phase}")]
        lines += [_row(f"  {k.replace('_', ' ')}", format_bytes(v)) for k, v in plan.gpu_breakdown.items()]
        resident = ", ".join(i.resident_units) or "none (no spare GPU memory, or no --gpu-memory)"
        lines.append(_row("on the GPU", resident, "units whose master and Adam state live on the GPU"))
    else:  # the CPU device computes in host RAM: there is no GPU memory to plan
        lines += ["", _row("GPU peak", "none", "the CPU device: every unit computes in host RAM")]
    placed = plan.placement_counts()
    if update_placement is not None:
        counts = ", ".join(f"{len(names)} {where}" for where, names in placed.items())
        lines.append(_row("update placement", update_placement, f"{counts} (units by where their update runs)"))
        if placed["streamed"]:
            lines.append(_row("  GPU-streamed", "", unit_names(placed["streamed"])))
    lines.append(_row("host peak", format_bytes(plan.host_peak_bytes)))
    lines += [_row(f"  {_host_buffer_name(k, plan)}", format_bytes(v)) for k, v in plan.host_breakdown.items() if v]
    if saving is not None and saving.in_background:
        copy = format_bytes(saving.copy_bytes)
        held = f"the copy a background save writes from, {copy}, held from the first save on"
        lines.append(_row(f"  with {option('save_async')}", format_bytes(saving.host_peak_bytes), held))
    lines.append(_row("disk", format_bytes(plan.disk_bytes), "NVMe: offloaded Adam state and activations"))
    if outputs is not None:
        lines.append(_row("output disk", format_bytes(outputs.total_bytes), "checkpoints and the exported model"))
        at_once = (
            f"none at the end ({option('keep_checkpoints', 0)}); a stop writes one of "
            f"{format_bytes(outputs.checkpoint_bytes)}"
            if outputs.export_only
            else f"{outputs.checkpoints_at_once} at once (kept, best, the one being written) x "
            f"{format_bytes(outputs.checkpoint_bytes)}"
        )
        lines.append(_row("  checkpoints", format_bytes(outputs.checkpoints_bytes), at_once))
        lines.append(_row("  export", format_bytes(outputs.export_bytes), "the HF model directory"))
        if saving is not None and not outputs.export_only:
            lines.append(_row("  each save", f"{saving.pause_s:.3g} s", saving.why()))
    lines.append(_row("params", f"{plan.params:,}"))
    lines.append(_row("max batch", _max_batch(plan, gpu_source)))
    if sequences is not None and i.accelerator:
        lines.append(_row("longest seq-len", *_longest(sequences, i.seq_len, gpu_source)))
    if i.accelerator:
        lines += _masks_rows(i)
    if not i.accelerator:
        lines.append(_row("step time", "not planned", "the CPU device: `slide train` measures its steps"))
        if optimizer is not None:
            lines.append(_row("optimizer", "", optimizer))
        lines.append(_row("fits", "yes" if problem is None else "no", problem or ""))
        return "\n".join(lines)
    lines.append(
        _row(
            "step time",
            f"{plan.step_time_s:.3g} s",
            f"compute {plan.compute_s:.3g} s, pcie {plan.pcie_s:.3g} s, "
            f"update {plan.update_s:.3g} s, nvme {plan.disk_s:.3g} s; {plan.tokens_per_s:,.0f} tokens/s",
        )
    )
    lines += [_row(f"  {name}", f"{seconds:.3g} s") for name, seconds in plan.resource_s.items()]
    if plan.resource_bound_s > 0:
        ordering = plan.step_time_s / plan.resource_bound_s - 1
        lines.append(
            _row(
                "  in engine order",
                f"{plan.step_time_s:.3g} s",
                f"{ordering:+.0%} on the busiest resource: loads wait for updates, slots and staging sets",
            )
        )
    if plan.clipped_step_time_s is not None:
        clipped_tokens_s = plan.tokens_per_step / plan.clipped_step_time_s if plan.clipped_step_time_s > 0 else 0
        lines.append(
            _row(
                "  while clipping fires",
                f"{plan.clipped_step_time_s:.3g} s",
                f"{clipped_tokens_s:,.0f} tokens/s: each step after one that clips waits for the norm "
                "before the host updates",
            )
        )
    if plan.reference_step_s is not None:
        lines.append(
            _row(
                "  reference pass",
                f"{plan.reference_step_s:.3g} s",
                "per step's worth of pairs, once before the first step (--objective dpo: a forward of each pair, "
                "held-out pairs at the same rate)",
            )
        )
    if rates_source is not None:
        lines.append(_row("  rates", "", rates_source))
    if not math.isfinite(plan.overlap):
        lines.append(_row("overlap", "n/a", "no gradient transfer or host update to hide behind the backward"))
    else:
        overlap_note = (
            "larger batches raise overlap" if plan.overlap < 1 else "gradient transfer and update hide behind backward"
        )
        lines.append(_row("overlap", f"{plan.overlap:.2f}", overlap_note))
    binding_s = plan.resource_s.get(plan.binding)
    lines.append(
        _row("binding limit", plan.binding, "" if binding_s is None else f"the largest resource, {binding_s:.3g} s")
    )
    critical = "n/a" if plan.critical_batch_size is None else str(plan.critical_batch_size)
    lines.append(_row("critical batch", critical, "smallest batch with overlap >= 1"))
    if optimizer is not None:
        lines.append(_row("optimizer", "", optimizer))
    lines.append(_row("fits", "yes" if problem is None else "no", problem or ""))
    return "\n".join(lines)


def _max_batch(plan: Plan, gpu_source: str) -> str:
    if plan.max_batch_size is None:
        return "n/a (no GPU or host budget)"
    limit = {"gpu": f"GPU memory, {gpu_source}", "host": "host RAM"}.get(plan.max_batch_limit or "", "")
    if plan.max_batch_size == 0:
        return f"none fits ({limit})"
    return f"{plan.max_batch_size}" + (f" (limited by {limit})" if limit else "")


def _masks_rows(inputs: PlanInputs) -> list[str]:
    """The "attention masks" row, where the run's attention builds (S x S) masks (on the GPU peak above)."""
    masks = attention_masks(inputs)
    if not masks.any:
        return []
    kinds = ", ".join(f"{layer_type} ({implementation})" for layer_type, implementation in masks.layers)
    note = (
        f"(S x S) for {kinds}: {format_bytes(masks.held_bytes)} held per micro-batch, "
        f"{format_bytes(masks.call_bytes)} more per attention call; {masks.remedy()}"
    )
    return [_row("attention masks", format_bytes(masks.held_bytes + masks.call_bytes), note)]


def _longest(sequences: SequenceFit, seq_len: int, gpu_source: str) -> tuple[str, str]:
    """The "longest seq-len" row: the longest ``--seq-len`` at batch 1 and, beside it, the tiling it was planned
    with and what the planned ``--seq-len`` needs at batch 1."""
    tiles = f"MLPs and norms in tiles of {sequences.seq_tile:,} tokens" if sequences.seq_tile else "untiled"
    tiles += ", --seq-tile auto" if sequences.seq_tile_auto else ""
    needs = f"--seq-len {seq_len} needs {format_bytes(sequences.seq_len_gpu_bytes)} at batch 1 ({tiles})"
    if sequences.longest_seq_len is None:
        return "n/a", f"no GPU budget; {needs}"
    bound = {"positions": "the model's positions", "host": "host RAM"}.get(sequences.limit, f"GPU memory {gpu_source}")
    if sequences.longest_seq_len == 0:
        return "none", f"not even 2 tokens fit the {bound}; {needs}"
    return f"{sequences.longest_seq_len:,}", f"at batch 1, limited by {bound}; {needs}"


def _count(params: int) -> str:
    """``8.03 B``, ``1.25 M``: a parameter count in the unit that shows its digits (a test model of a few
    million parameters read "0.00 B")."""
    return f"{params / 1e9:.2f} B" if params >= 10**9 else f"{params / 1e6:.2f} M"


def _row(label: str, value: str, note: str = "") -> str:
    text = f"{label:<22}{value:>12}"
    return f"{text}   {note}" if note else text


def unit_names(names: tuple[str, ...]) -> str:
    """``embedding, block.0-11, head``: unit names with runs of consecutive numbered units of one prefix
    (``block.N``, or a model's own ``layers.N``) as one range."""
    parts: list[str] = []
    run: list[int] = []
    prefix = ""

    def close() -> None:
        if run:
            parts.append(f"{prefix}{run[0]}" if len(run) == 1 else f"{prefix}{run[0]}-{run[-1]}")
            run.clear()

    for name in names:
        head, _, index = name.rpartition(".")
        if head and index.isdigit():
            if run and (f"{head}." != prefix or int(index) != run[-1] + 1):
                close()
            prefix = f"{head}."
            run.append(int(index))
            continue
        close()
        parts.append(name)
    close()
    return ", ".join(parts)


def _host_buffer_name(key: str, plan: Plan) -> str:
    """A host buffer's row: its ledger name (the run's, slide_core/allocation_ledger.py), the master's by the
    format the run stores it in (a split master is its bf16 plane and its low bits, not one fp32 slab)."""
    if key == "master_fp32":
        return f"master ({plan.inputs.master_format})"
    return key.replace("_", " ")
