"""Which format the host master is stored in (``EngineConfig.master_format``), and what each one needs.

The format is fixed when :class:`~slide_core.host_params.HostParameters` is allocated, before the
weights are loaded into it, so the caller resolves ``auto`` with :func:`choose_master_format` and the
engine only checks that what it is handed can run (:func:`check_master_format`). The split master
(slide_core/split_master.py) holds the bf16 rounding of every value as a plane of its own, which is the
compute copy only when the compute dtype is bf16; and the optimizer must step it exactly
(``Optimizer.split_master``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from slide_core.host_params import HostParameters, MasterFormat

if TYPE_CHECKING:
    from slide_core.optimizer import Optimizer

    from .config import EngineConfig

__all__ = ["MASTER_FORMATS", "check_master_format", "choose_master_format"]

MASTER_FORMATS = ("auto", "fp32", "split")


def choose_master_format(
    requested: str, compute_dtype: torch.dtype, optimizer: Optimizer, *, accelerator: bool = True
) -> MasterFormat:
    """The format to allocate: ``fp32`` or ``split`` as asked (split refused in one line where it cannot
    run), and for ``auto`` split whenever it can run (bf16 compute, an optimizer that steps it) on an
    ``accelerator``. What split saves is half the bytes each load sends to the device (measured 1.20x on an
    8B step and 1.08x on a 3B one on an H100 host); the CPU device sends nothing across a link, and its
    host step decodes and encodes the split halves, so ``auto`` keeps one fp32 slab there."""
    if requested not in MASTER_FORMATS:
        raise ValueError(f"master format must be one of {', '.join(MASTER_FORMATS)}, got {requested!r}")
    if requested == "fp32" or (requested == "auto" and not accelerator):
        return "fp32"
    reason = _split_refused(compute_dtype, optimizer)
    if requested == "split" and reason is not None:
        raise ValueError(f"the split master cannot run here: {reason}")
    return "fp32" if reason is not None else "split"


def check_master_format(host_params: HostParameters, config: EngineConfig, optimizer: Optimizer) -> None:
    """Refuse, in one line, a master whose format the config names otherwise or that cannot run."""
    held = host_params.master_format
    if config.master_format != "auto" and config.master_format != held:
        raise ValueError(
            f"EngineConfig.master_format is {config.master_format} but host_params holds a {held} master; "
            f"allocate HostParameters(..., master_format={config.master_format!r})"
        )
    if held == "split":
        reason = _split_refused(config.compute_dtype, optimizer)
        if reason is not None:
            raise ValueError(f"host_params holds a split master, which cannot run here: {reason}")


def _split_refused(compute_dtype: torch.dtype, optimizer: Optimizer) -> str | None:
    if compute_dtype != torch.bfloat16:
        dtype = str(compute_dtype).removeprefix("torch.")
        return f"it stores the bf16 copy the device computes with, and the compute dtype is {dtype} (use fp32)"
    if not optimizer.split_master:
        return f"{type(optimizer).__name__} cannot step it (Optimizer.split_master is False; use fp32)"
    return None
