"""AdamW in one fused, multi-threaded pass over a flat host range, compiled with numba.

Why: on the host the optimizer step is memory-bound, and it is the engine's bottleneck. Per parameter,
``TorchAdamW`` first casts the bf16 gradient into an fp32 scratch (read 2 bytes, write 4, plus 4 of
write-allocate) and then runs ``torch._fused_adamw_`` (read the fp32 gradient 4, read+write master 8,
exp_avg 8, exp_avg_sq 8): ~38-40 bytes per parameter through DRAM. This kernel reads the bf16 gradient
directly and widens it in registers (zero-extend, shift, bitcast), so a step moves 26 bytes per parameter (grad 2 + master 8 + exp_avg 8
+ exp_avg_sq 8): at the same bandwidth that is ~1.5x the parameters per second. Clipping's speculative
updates pass ``grad_scale`` (docs/design/engine.md, "Clipping"), and the kernel multiplies there too, so a
clipped step still moves 26 bytes per parameter instead of first writing ``c * g`` to an fp32 scratch
(~42 B/param).

The arithmetic, and the split master's kernels, are documented with the kernels
(slide_core/optim/_adamw_kernels.py); a range's format picks its kernel (``MasterRange.format``).

numba is optional: nothing here imports it until a kernel is first needed (``step`` or ``warmup``), and
``import slide_core`` never does. ``best_adamw`` picks this optimizer when numba is importable and
falls back to ``TorchAdamW`` otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from slide_core.master_store import MasterRange, as_master_range
from slide_core.optim import _adamw_kernels
from slide_core.optim._adamw_kernels import BLOCK, fused_correct, grad_array, step_scalars
from slide_core.optim._adamw_kernels import numba_available as _numba_available
from slide_core.optim.adamw import TorchAdamW
from slide_core.optim.adamw_base import AdamWOptimizer
from slide_core.optim.adamw_config import AdamWConfig
from slide_core.split_master import SplitMaster, kernel_array

__all__ = ["BLOCK", "FusedAdamW", "best_adamw", "fused_correct"]

log = logging.getLogger(__name__)


class FusedAdamW(AdamWOptimizer):
    """AdamW (decoupled weight decay, applied only to ranges flagged ``decay``) as one numba kernel.

    ``grad`` may be bf16 (read as raw 16-bit words, never materialised in fp32), fp32, or any other float
    dtype (cast into a reserved fp32 scratch first, like ``TorchAdamW``). ``grad_scale`` is applied in
    registers, never through a scaled copy. ``threads`` caps numba's worker count for this optimizer's calls
    (default: all of numba's threads, i.e. every core).
    """

    def __init__(self, config: AdamWConfig, *, threads: int | None = None) -> None:
        super().__init__(config)
        self._refuse_compact_state()
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._flags = np.empty(0, dtype=np.uint8)  # a split master's unpacked tie bits, one byte per element
        self._reserved = 0
        self._off_host: TorchAdamW | None = None

    def device_replica(self) -> TorchAdamW:
        """Device ranges go through torch's kernels (numba runs on the host only)."""
        return TorchAdamW(self.config)

    def _device_fallback(self) -> TorchAdamW:
        """Ranges that live on an accelerator go through torch's kernels (numba only runs on the host)."""
        if self._off_host is None:
            self._off_host = TorchAdamW(self.config)
        return self._off_host

    @staticmethod
    def available() -> bool:
        """Whether numba imports here (the kernels are compiled on first use, not by this check)."""
        return _numba_available()

    def host_scratch_bytes(self, max_range_numel: int, *, corrects: bool = False, split_master: bool = False) -> int:
        """A split master's unpacked tie bits (one byte per element of the reserved range) and, with
        ``corrects``, the torch-ops correction's pieces. bf16 and fp32 gradients need no fp32 scratch."""
        if max_range_numel <= 0:
            return 0
        held = max_range_numel if split_master else 0
        if corrects:
            held += self._correction.host_scratch_bytes(max_range_numel, split_master=split_master)
        return held

    def reserve(self, max_range_numel: int, device: torch.device | str = "cpu") -> None:
        """Remember the largest host range. The fp32 scratch is needed only for gradients that are neither
        bf16 nor fp32 (e.g. fp16), so it is allocated, at this size, the first time one arrives rather than
        here: bf16/fp32 training never holds the 4 B/elt the cast-first ``TorchAdamW`` needs."""
        device = torch.device(device)
        if device.type != "cpu":
            self._device_fallback().reserve(max_range_numel, device)
        else:
            self._reserved = max(self._reserved, max_range_numel)

    def _kernels(self) -> Any:
        if not _numba_available():
            raise RuntimeError("FusedAdamW needs numba (pip install numba); use TorchAdamW without it")
        kernels = _adamw_kernels.kernels()
        if self.threads is not None:
            # numba's thread count is a per-calling-thread setting, so it is checked on every call (~1 us).
            want = min(self.threads, kernels.max_threads)
            if kernels.get_num_threads() != want:
                kernels.set_num_threads(want)
        return kernels

    def warmup(self) -> None:
        """Compile (or load from cache) the bf16 and fp32 kernels on tiny arrays, off the critical path."""
        config = AdamWConfig(weight_decay=0.1)
        master = torch.ones(3)
        state = {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
        split = SplitMaster(
            torch.ones(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int16), torch.zeros(1, dtype=torch.uint8)
        )
        for target in (master, split):
            for dtype in (torch.bfloat16, torch.float32):
                FusedAdamW(config, threads=self.threads).step(
                    target, torch.ones(3, dtype=dtype), state, lr=1e-3, step=1, decay=True
                )

    def step(
        self,
        master: torch.Tensor | MasterRange,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
        grad_scale: float = 1.0,
    ) -> None:
        master = as_master_range(master)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        n = master.numel()
        if not (grad.numel() == exp_avg.numel() == exp_avg_sq.numel() == n):
            raise ValueError(
                f"range sizes differ: master {n}, grad {grad.numel()}, "
                f"exp_avg {exp_avg.numel()}, exp_avg_sq {exp_avg_sq.numel()}"
            )
        for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if t.dtype != torch.float32:
                raise ValueError(f"{name} must be fp32, got {t.dtype}")
        if n == 0:
            return
        if master.device.type != "cpu":
            self._device_fallback().step(master, grad, state, lr=lr, step=step, decay=decay, grad_scale=grad_scale)
            return
        kernels = self._kernels()
        args = step_scalars(self.config, lr, step, decay)
        m, v = kernel_array(exp_avg, "exp_avg"), kernel_array(exp_avg_sq, "exp_avg_sq")
        if grad.dtype not in (torch.bfloat16, torch.float32):
            if self._scratch.numel() < n:
                self._scratch = torch.empty(max(n, self._reserved), dtype=torch.float32)
            grad = self._scratch[:n].copy_(grad)
        g = grad_array(grad)  # bf16 as raw bits, widened in registers
        # One kernel for every scale: multiplying by 1.0f is exact, and the scale is always an fp32 scalar,
        # so the compiled (and cached) signatures are the same two as without clipping (bf16, fp32 grads).
        operands = master.kernel_operands(self._flag_scratch(master.kernel_flags_numel()))
        kernels.step[master.format](*operands, g, m, v, np.float32(grad_scale), *args)

    def _flag_scratch(self, numel: int) -> np.ndarray:
        """At least ``numel`` scratch bytes for a split master's unpacked tie bits (kept, grown to the
        largest reserved range; none for an fp32 master)."""
        if self._flags.shape[0] < numel:
            self._flags = np.empty(max(numel, self._reserved), dtype=np.uint8)
        return self._flags


def best_adamw(config: AdamWConfig, *, threads: int | None = None, warmup: bool = True) -> AdamWOptimizer:
    """The fastest host AdamW this environment can run: ``FusedAdamW`` with numba, else ``TorchAdamW``.

    With ``warmup`` (the default) the kernels are compiled (or loaded from numba's cache) here, off the
    training critical path, and a compile failure falls back to ``TorchAdamW`` instead of failing the
    first step. ``threads`` applies to ``FusedAdamW`` only.
    """
    if not FusedAdamW.available():
        log.info("host optimizer: TorchAdamW (numba not importable; bf16 grads cast first, ~40 B/param)")
        return TorchAdamW(config)
    optimizer = FusedAdamW(config, threads=threads)
    if warmup:
        try:
            optimizer.warmup()
        except Exception:
            log.warning("host optimizer: FusedAdamW failed to compile, using TorchAdamW", exc_info=True)
            return TorchAdamW(config)
    log.info("host optimizer: FusedAdamW (numba, one fused pass, 26 B/param)")
    return optimizer
