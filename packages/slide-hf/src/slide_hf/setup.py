"""One way to set up a run: device, plan and placement, optimizer, tiers and engine.

`slide train` (recipe.py) and `slide bench` (bench.py) build their engines here, in this order, so a
benchmark measures exactly the run a user would get; `slide plan` resolves its device and tier names here
too. Each choice a user names is an entry point, loaded through :mod:`slide_core.plugins`:

- ``--device NAME`` (``slide.devices``): ``auto`` is ``rocm`` on a HIP build of torch with a GPU, ``cuda``
  with a CUDA GPU, else ``cpu`` (:func:`slide_core.devices.auto_device_name`). Every device is built as
  ``cls(memory_limit_bytes=...)``.
- ``--offload-optimizer NAME`` (``slide.tiers``): where the Adam state of ``--nvme-fraction`` of the units
  goes; ``ram`` keeps it in host RAM (slide_hf/offload.py).
- ``--optimizer NAME`` (``slide.optimizers``): ``auto`` is the fused one-pass AdamW when numba runs here,
  else torch's (:func:`slide_core.optim.build_optimizer`).

Nothing here parses flags or prints; the options arrive checked (slide_hf/options), and an error the user can
fix here (a plugin that does not load, a tier that cannot open) is a one-line ``UserError`` naming the option.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slide_core import AdamWConfig, HostParameters, Optimizer, plugins
from slide_core.collectives import Collectives
from slide_core.device import Device
from slide_core.devices import auto_device_name
from slide_core.engine import Engine, EngineConfig
from slide_core.master_store import MasterFormat
from slide_core.optim import build_optimizer
from slide_core.tier import Tier, TierRequest
from slide_hf.defaults import check_seq_tile, resolve_seq_tile
from slide_hf.device_defaults import apply_device_defaults
from slide_hf.errors import UserError
from slide_hf.offload import (
    activation_tier_class,
    open_activation_tier,
    open_tier,
    planning_kind,
    state_tier_capacity,
    state_tier_class,
)
from slide_hf.options import TrainConfig, engine_values
from slide_hf.spelling import option

__all__ = [
    "EngineParts",
    "Placement",
    "RunOptions",
    "flops_per_token",
    "make_device",
    "make_optimizer",
    "open_engine",
    "place_units",
]

log = logging.getLogger("slide.setup")


@dataclass(frozen=True)
class RunOptions:
    """What `slide train` and `slide bench` decide the same way: the engine-facing part of a run's options,
    typed as this module reads them.

    Built only by :meth:`from_config`, from the options a :class:`~slide_hf.options.TrainConfig` declares
    with ``engine=`` (slide_hf/options/config.py), under the names and with the conversions declared there;
    each field here is one of those, but ``report_grad_norm``, which the run derives."""

    device: str
    gpu_memory_bytes: int | None
    optimizer: str
    optimizer_state: str
    master: str
    offload_optimizer: str
    nvme_dir: Path | None
    nvme_fraction: float
    offload_activations: str
    block_slots: int
    seq_tile: int | None
    compute_dtype: torch.dtype
    batch_size: int
    seq_len: int
    grad_accum: int
    max_grad_norm: float
    update_placement: str
    report_grad_norm: bool
    packed_rows: bool
    """Rows may hold several documents (``--no-packing`` off; `slide bench`'s random rows do not): with
    SDPA, their attention needs explicit (S x S) masks, which the plan prices."""
    objective: str
    """``--objective``: a preference run's head computes the log-probabilities in one more LM-head pass,
    and DPO's reference pass runs before the first step; the plan prices both."""

    @classmethod
    def from_config(
        cls, cfg: TrainConfig, *, report_grad_norm: bool | None = None, seq_len: int | None = None
    ) -> RunOptions:
        """The engine's options of the run ``cfg`` describes (its ``seq_len`` resolved, slide_hf/defaults.py).

        ``report_grad_norm``: whether each step reports the gradient norm; by default only where it costs
        nothing: with several micro-batches the final gradient exists only on the host, and its norm would
        make every step wait for the whole host update (see EngineConfig.report_grad_norm); clipping needs
        the norm anyway."""
        if report_grad_norm is None:
            report_grad_norm = cfg.grad_accum == 1 or cfg.max_grad_norm > 0
        values = {**engine_values(cfg), "report_grad_norm": report_grad_norm, "packed_rows": cfg.packing}
        if seq_len is not None:  # resolved from the model by the caller (`slide plan`)
            values["seq_len"] = seq_len
        unresolved = sorted(name for name in _REQUIRED_FIELDS if values.get(name) is None)
        if unresolved:
            raise ValueError(f"RunOptions needs {', '.join(unresolved)} resolved first (slide_hf/defaults.py)")
        check_seq_tile(values["seq_tile"], values["batch_size"], values["seq_len"])
        return cls(**values)


@dataclass(frozen=True)
class Placement:
    """Which units live where, and the plan that was checked against the machine's budgets."""

    plan: Any  # slide_hf.planner.Plan of the placed run
    resident: tuple[str, ...]
    """Units whose master and Adam state live on the GPU."""
    state_tier: type[Tier] | None
    """The tier class for the Adam state of ``offloaded``; None: host RAM."""
    offloaded: tuple[str, ...] = ()
    """Units whose Adam state is on ``state_tier`` (chosen once the model's units are known)."""
    streamed: tuple[str, ...] = ()
    """Units updated on the GPU as they stream through it (``--update-placement``)."""


_REQUIRED_FIELDS = frozenset(
    name for name, hint in typing.get_type_hints(RunOptions).items() if type(None) not in typing.get_args(hint)
)
"""The fields that take no ``None``: an option's ``None`` there is a choice the run resolves first (``seq_len``)."""


# -- device ------------------------------------------------------------------------------------------------
def make_device(name: str, memory_limit_bytes: int | None = None, *, index: int = 0) -> Device:
    """The ``slide.devices`` plugin ``name`` (or ``auto``), closed, capped at ``memory_limit_bytes``.

    ``cuda`` on a HIP build of torch is the ``rocm`` device, as torch itself calls AMD GPUs ``cuda``.
    ``index``: which GPU (a data-parallel rank's, ``ProcessGroupContext.device_index``); a plugin is then
    built with ``index=`` as the shipped GPU devices are, and one that takes no index is refused in one
    line."""
    resolved = auto_device_name() if name == "auto" else name
    if resolved == "cuda" and torch.version.hip:
        resolved = "rocm"
    if resolved in ("cuda", "rocm") and not torch.cuda.is_available():
        raise UserError(
            f"{option('device', name)} was asked for, but torch sees no GPU; use {option('device', 'auto')} or cpu"
        )
    try:
        device_class = plugins.load("slide.devices", resolved, expected=Device)
    except plugins.PluginError as error:
        raise UserError(f"{option('device', name)}: {error}") from None
    where = {"index": index} if index else {}
    try:
        device: Device = device_class(memory_limit_bytes=memory_limit_bytes, **where)
    except TypeError:
        if not where:
            raise
        raise UserError(
            f"{option('device', name)}: the {resolved} device plugin cannot be told which GPU to use (no index "
            f"argument), which data parallel needs for local rank {index}"
        ) from None
    except (RuntimeError, ValueError) as error:  # no such GPU, no HIP build, a bad cap
        raise UserError(f"{option('device', name)}: {str(error).splitlines()[0]}") from None
    if memory_limit_bytes is not None and not device.is_accelerator:
        log.warning("%s is ignored on the CPU device", option("gpu_memory"))
    return device


# -- optimizer ---------------------------------------------------------------------------------------------
def make_optimizer(name: str, adam: AdamWConfig) -> Optimizer:
    """The ``slide.optimizers`` plugin ``name`` (or ``auto``) built with ``adam``, kernels compiled."""
    try:
        optimizer = build_optimizer(name, adam)
    except plugins.PluginError as error:
        raise UserError(f"{option('optimizer', name)}: {error}") from None
    _attach_device_kernels(optimizer)
    return optimizer


def _attach_device_kernels(optimizer: Optimizer) -> None:
    """Give the compact optimizer the one-pass Triton step for its device ranges (GPU-resident and
    GPU-streamed units): its torch path makes some thirty passes over memory per chunk. Give every
    optimizer that takes a split master the one-launch codec for the staged masters of GPU-streamed units
    (``Optimizer.split_codec``): the torch one issues thousands of launches per block."""
    from slide_core.optim.compact_adamw import CompactAdamW
    from slide_kernels.ops.compact_adamw import adamw_compact_moments
    from slide_kernels.ops.split_master import TritonSplitCodec

    if isinstance(optimizer, CompactAdamW) and optimizer.device_kernel is None:
        optimizer.device_kernel = adamw_compact_moments
    if optimizer.split_master:
        optimizer.split_codec = TritonSplitCodec()


# -- plan and placement ------------------------------------------------------------------------------------
def place_units(
    model: Any,
    device: Device,
    options: RunOptions,
    *,
    resident_bytes: int | None = None,
    optimizer: Optimizer | None = None,
    replaceable: bool = False,
    measure_machine: bool = False,
) -> Placement:
    """Check the run fits (host RAM, GPU budget) before anything is allocated, then choose the units that
    live on the GPU (``resident_bytes`` of them, else whatever the GPU budget leaves spare) and those whose
    Adam state goes to the ``--offload-optimizer`` tier, then, by ``--update-placement``, those updated on the
    GPU as they stream (slide_hf/planner/plan.py; ``auto`` plans with this machine's measured rates when
    `slide doctor` has cached them). ``optimizer``: the run's, whose scratch the plan prices and whose
    ``--master`` it resolves (None: the one ``options`` name, built without compiling). ``replaceable``:
    with ``auto``, the run may move units between the host and the GPU-streamed update from the rates its
    own steps measure (slide_hf/replacement.py), so the plan prices the staging that needs.
    ``measure_machine``: on an accelerator whose rates `slide doctor` never cached, measure them first (a
    few seconds, once per machine; slide_hf/machine_rates.py), where the documented defaults would plan a
    slow machine's steps and place the units for one."""
    from slide_core.engine.placement import choose_resident_units
    from slide_hf.adapters.token_tiles import use_seq_tile
    from slide_hf.in_step_rates import learned_inputs
    from slide_hf.machine_rates import planning_bandwidths
    from slide_hf.planner import (
        Bandwidths,
        available_host_bytes,
        check_fits,
        device_gpu_budget,
        make_plan,
        plan_with_placement,
    )

    apply_device_defaults(model, device)  # before anything logs or plans the attention this run takes
    tier_class = state_tier_class(options.offload_optimizer)
    gpu_budget = device_gpu_budget(device)
    inputs = plan_inputs(
        model,
        options,
        accelerator=device.is_accelerator,
        gpu_memory_bytes=gpu_budget,
        optimizer=optimizer if optimizer is not None else unbuilt_optimizer(options),
        bandwidths=planning_bandwidths(measure_if_absent=measure_machine)[0] if device.is_accelerator else Bandwidths(),
    )
    if device.is_accelerator:  # what earlier runs measured in their steps here (slide_hf/in_step_rates.py)
        inputs, learned = learned_inputs(inputs)
        if learned is not None:
            log.info("plan rates: %s", learned)
    host_available = available_host_bytes()
    # The host side is checked on the placed plan: GPU-streamed units need no gradient ring on the host
    # (Note [The ring is sized for the host's units]), so a run that fits only once placed is not refused.
    check_fits(make_plan(inputs), host_available=None, gpu_available=gpu_budget)
    if resident_bytes is None:
        plan = plan_with_placement(inputs, str(options.update_placement), replaceable=replaceable)
    else:
        chosen = choose_resident_units(
            model,
            resident_bytes,
            options.compute_dtype,
            accumulates=options.grad_accum > 1,
            state_arrays=inputs.device_optimizer().state_arrays,
        )
        plan = make_plan(dataclasses.replace(inputs, resident_units=chosen))
    check_fits(plan, host_available=host_available, gpu_available=None)
    use_seq_tile(model, plan.inputs.seq_tile)  # the tile the plan priced (``auto``: the one it chose)
    resident, streamed = plan.inputs.resident_units, plan.inputs.streamed_units
    # The units on the state tier: the plan's own rule (PlanInputs.offloaded_units).
    return Placement(plan, resident, tier_class, plan.inputs.offloaded_units, streamed)


def resolve_master(options: RunOptions, optimizer: Optimizer, *, accelerator: bool) -> MasterFormat:
    """``--master`` as the run allocates it: :func:`~slide_core.engine.choose_master_format` (``auto`` is split
    where it can run on an ``accelerator``), its refusal one line naming the option. The plan resolves it
    (``PlanInputs.master_format``) and the run allocates the plan's."""
    from slide_core.engine import choose_master_format

    try:
        return choose_master_format(options.master, options.compute_dtype, optimizer, accelerator=accelerator)
    except ValueError as error:
        raise UserError(f"{option('master', options.master)}: {error}") from None


def unbuilt_optimizer(options: RunOptions) -> Optimizer:
    """The optimizer the run steps with (``--optimizer``, ``--optimizer-state``), built without compiling
    anything: what a plan prices the scratch of and resolves ``--master`` with before (or without) the run
    builds its own (slide_core's ``build_optimizer``)."""
    from slide_core.optim import build_optimizer

    try:
        return build_optimizer(options.optimizer, AdamWConfig(state_format=options.optimizer_state), warmup=False)
    except plugins.PluginError as error:
        raise UserError(f"{option('optimizer', options.optimizer)}: {error}") from None


def plan_inputs(
    model: Any,
    options: RunOptions,
    *,
    accelerator: bool,
    gpu_memory_bytes: int | None,
    bandwidths: Any,
    optimizer: Optimizer,
    host_memory_bytes: int | None = None,
) -> Any:
    """The :class:`~slide_hf.planner.PlanInputs` of the run ``options`` describe: the one builder `slide
    train`, `slide bench` and `slide plan` share, so the plan a user reads prices the run they get
    (the engine is then built from ``plan.inputs.engine_config()``). What differs between the commands is
    only what they know of the machine: ``accelerator`` (the run computes on a GPU), the budgets,
    ``bandwidths``. ``optimizer``: the run's, built or not (:func:`unbuilt_optimizer`, which `slide plan` and
    `slide bench` plan with): the ``--master`` it can step and the scratch it keeps are its own."""
    from slide_hf.offload import activation_tier_class, state_tier_class
    from slide_hf.planner import PlanInputs

    state_tier = state_tier_class(options.offload_optimizer)
    activation_tier = activation_tier_class(options.offload_activations)
    inputs = PlanInputs(
        model,
        batch_size=options.batch_size,
        seq_len=options.seq_len,
        seq_tile=resolve_seq_tile(options.seq_tile, options.seq_len),
        packed_rows=options.packed_rows,
        grad_accum=options.grad_accum,
        compute_dtype_bytes=torch.empty((), dtype=options.compute_dtype).element_size(),
        block_slots=options.block_slots,
        gpu_memory_bytes=gpu_memory_bytes,
        host_memory_bytes=host_memory_bytes,
        accelerator=accelerator,
        max_grad_norm=options.max_grad_norm,
        report_grad_norm=options.report_grad_norm,
        objective=options.objective,
        offload_optimizer=planning_kind(state_tier),
        state_tier=state_tier is not None,
        state_tier_class=state_tier,
        nvme_fraction=options.nvme_fraction,
        offload_activations=planning_kind(activation_tier),
        activation_tier_class=activation_tier,
        optimizer_state=options.optimizer_state,
        master_format=resolve_master(options, optimizer, accelerator=accelerator),
        optimizer=optimizer,
        fused_loss=fused_loss_available(),
        bandwidths=bandwidths,
    )
    if options.seq_tile is None:  # --seq-tile auto: the planner's choice, the same for the plan and the run
        from slide_hf.planner.auto_tile import auto_seq_tile

        inputs = dataclasses.replace(inputs, seq_tile=auto_seq_tile(inputs, gpu_memory_bytes))
    return inputs


def fused_loss_available() -> bool:
    """Whether slide-kernels (its chunked linear + cross-entropy) is installed here; without it the
    adapters' head materialises the logits, which the plan must count. Checked without importing it."""
    import importlib.util

    return importlib.util.find_spec("slide_kernels") is not None


def engine_config(placement: Placement) -> EngineConfig:
    """The engine config of a placed run: the plan's own (:meth:`PlanInputs.engine_config`), with the
    units every rank places alike (rank 0's choice, broadcast; in one process, the plan's)."""
    return dataclasses.replace(
        placement.plan.inputs.engine_config(),
        resident_units=placement.resident,
        offloaded_units=placement.offloaded,
        streamed_units=placement.streamed,
    )


# -- engine ------------------------------------------------------------------------------------------------
@dataclass
class EngineParts:
    """The engine and the tiers it borrows. A context manager: entering runs the engine; leaving closes the
    engine, then the tiers (an engine must stop using a tier before the tier goes)."""

    engine: Engine
    optimizer: Optimizer
    tiers: tuple[Tier, ...] = ()

    def __enter__(self) -> Engine:
        try:
            return self.engine.__enter__()
        except BaseException:  # the engine could not start (out of memory, a bad tier): nothing will exit it
            self._close_tiers()
            raise

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self.engine.__exit__(*exc_info)
        finally:
            self._close_tiers()

    def _close_tiers(self) -> None:
        for tier in self.tiers:
            tier.close()


def open_engine(
    model: Any,
    device: Device,
    host: HostParameters,
    optimizer: Optimizer,
    options: RunOptions,
    placement: Placement,
    *,
    scratch: Callable[[], Path],
    process_group: Collectives | None = None,
) -> EngineParts:
    """Open the tiers the placement needs (each in its own ``scratch()`` directory when it keeps files) and
    build the engine over them; the engine runs once the result is entered. ``process_group``: this
    process's place in the run (docs/distributed.md; a world of one by default)."""
    config = engine_config(placement)
    plan = placement.plan
    if device.is_accelerator:
        clipped = (
            "" if plan.clipped_step_time_s is None else f" ({plan.clipped_step_time_s:.3g} s while clipping fires)"
        )
        log.info(
            "plan: GPU peak %.2f GiB, host peak %.2f GiB, step %.3g s%s",
            plan.gpu_peak_bytes / 2**30,
            plan.host_peak_bytes / 2**30,
            plan.step_time_s,
            clipped,
        )
    else:  # the CPU device's memory is the host's; the planner has no CPU compute rate for its step
        log.info("plan: host peak %.2f GiB (the CPU device)", plan.host_peak_bytes / 2**30)
    if placement.resident:
        log.info("device-resident units (master + Adam state on the GPU): %s", ", ".join(placement.resident))
    if placement.streamed:
        log.info("units updated on the GPU as they stream: %s", ", ".join(placement.streamed))
    if placement.plan.inputs.streamable_units:  # slide_hf/replacement.py
        from slide_hf.replacement import compact_units

        movable = compact_units(placement.plan.inputs.streamable_units, [unit.name for unit in model.units])
        log.info("units that may move to the GPU-streamed update as the steps measure the rates: %s", movable)
    with contextlib.ExitStack() as opened:
        state_tier = None
        if placement.offloaded and placement.state_tier is not None:
            tier_class = placement.state_tier
            numels = [unit.layout.numel for unit in model.units if unit.name in placement.offloaded]
            request = TierRequest(
                directory=scratch() if tier_class.on_disk else None,
                device=device,
                capacity_bytes=state_tier_capacity(optimizer.state_arrays, numels),
            )
            state_tier = open_tier(tier_class, request, flag=option("offload_optimizer"))
            opened.callback(state_tier.close)
            where = f" ({options.nvme_dir})" if tier_class.on_disk else ""
            log.info("Adam state on the %s tier%s for %d units", state_tier.name, where, len(placement.offloaded))
        activation_tier = None
        on_disk = activation_tier_class(options.offload_activations)  # None: the engine's host stash
        if on_disk is not None:
            activation_tier = open_activation_tier(on_disk, scratch(), device)
            opened.callback(activation_tier.close)
            log.info("block inputs on the %s tier in %s", activation_tier.name, options.nvme_dir)
        engine = Engine(
            model,
            device,
            host,
            optimizer,
            config,
            state_tier=state_tier,
            activation_tier=activation_tier,
            process_group=process_group,
        )
        opened.pop_all()  # from here the tiers are the parts' to close
    tiers = tuple(tier for tier in (state_tier, activation_tier) if tier is not None)
    return EngineParts(engine, optimizer, tiers)


# -- reporting ---------------------------------------------------------------------------------------------
def flops_per_token(config: Any, params: int, seq_len: int) -> float:
    """Model FLOPs per token: 6N for the matmuls plus 12·L·H·S for attention scores (fwd+bwd).

    The engine's recompute forward is not counted, so TFLOPS compares fairly with a run that keeps its
    activations (`slide bench`'s plain PyTorch reference is credited the same work)."""
    layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0))
    return 6.0 * params + 12.0 * layers * hidden * seq_len
