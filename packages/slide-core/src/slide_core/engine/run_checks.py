"""What an engine refuses before it allocates anything, each in one line that says what to change."""

from __future__ import annotations

import torch

from slide_core.collectives import Collectives
from slide_core.device import Device
from slide_core.host_params import HostParameters
from slide_core.optim.state_formats import QUANT_BLOCK
from slide_core.optimizer import Optimizer
from slide_core.unit import SlideModel

from .config import EngineConfig
from .master_format import check_master_format

__all__ = ["check_run", "check_state_format"]


def check_run(
    model: SlideModel,
    device: Device,
    host_params: HostParameters,
    optimizer: Optimizer,
    config: EngineConfig,
    collectives: Collectives,
) -> None:
    """Refuse a run whose parts do not fit together: another model's master, a closed device, clipping
    with an optimizer that cannot correct, a master or state format the placement does not run with, a
    device the collectives cannot use. (int8 state under data parallel is refused before any process
    starts, by slide_hf.options.check_data_parallel.)"""
    if host_params.model is not model:
        raise ValueError("host_params was built for a different model")
    if not device.is_open:
        raise ValueError("open the device first: `with device:` or device.open()")
    if config.clipping and not optimizer.corrects:
        raise ValueError(
            f"max_grad_norm needs an optimizer that can correct an applied update (Optimizer.correct); "
            f"{type(optimizer).__name__} cannot"
        )
    check_master_format(host_params, config, optimizer)
    collectives.check_device(device)
    check_state_format(optimizer, config)


def check_state_format(optimizer: Optimizer, config: EngineConfig) -> None:
    """Refuse, in one line, the placements a compact optimizer state does not run with (yet)."""
    state_format = optimizer.state_format
    if state_format == "fp32":
        return
    if all(array.dtype == torch.float32 for array in optimizer.state_arrays):
        raise ValueError(
            f"{type(optimizer).__name__} keeps fp32 state, but its config asks for {state_format}; "
            "use CompactAdamW (build_optimizer picks it)"
        )
    if state_format == "int8" and config.transfer_chunk_numel % QUANT_BLOCK:
        raise ValueError(
            f"int8 optimizer state needs transfer_chunk_numel to be a multiple of {QUANT_BLOCK} (its block), "
            f"got {config.transfer_chunk_numel}"
        )
