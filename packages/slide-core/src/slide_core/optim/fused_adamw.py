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

The arithmetic is ``torch.optim.AdamW(foreach=False)``'s, op for op, in fp32, with the scalars computed
in Python float64 and rounded to fp32 exactly where torch rounds them:

    g  = f32(grad) * f32(grad_scale)                     # scale_into's copy_ + mul_ (exact at 1)
    p  = p * f32(1 - lr*wd)                              # mul_ (only when decaying)
    m  = fma(c, g - m, m if w < .5 else g)               # lerp_(g, w), w = 1 - beta1; c = w or w - 1
    v  = fma(f32(1 - beta2) * g, g, v * f32(beta2))      # mul_(beta2).addcmul_(g, g, value=1 - beta2)
    d  = sqrt(v) / f32(sqrt(1 - beta2**t)) + f32(eps)
    p  = p + (f32(-lr / (1 - beta1**t)) * m) / d         # addcdiv_(m, d, value=-step_size)

The two fused multiply-adds are there because torch's CPU kernels have them: ``lerp`` calls
``vec::fmadd`` explicitly and GCC contracts ``addcmul``'s ``self + value*t1*t2``; with them exp_avg and
exp_avg_sq come out bit-identical to torch's on AVX2/AVX512 builds. ``p`` can still differ by an ulp of
the update: torch's ``sqrt`` on x86 goes through MKL VML in high-accuracy mode (< 1 ulp, not correctly
rounded), while this kernel's ``sqrt`` is the IEEE one.

numba is optional: nothing here imports it until a kernel is first needed (``step`` or ``warmup``), and
``import slide_core`` never does. ``best_adamw`` picks this optimizer when numba is importable and
falls back to ``TorchAdamW`` otherwise.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from slide_core.optim.adamw import TorchAdamW
from slide_core.optim.adamw_correction import AdamWCorrection
from slide_core.optimizer import AdamWConfig, Coefficient, Correction, Optimizer

__all__ = ["FusedAdamW", "best_adamw"]

log = logging.getLogger(__name__)

BLOCK = 4096
"""Elements per parallel work item: ~4k items per 16M range, plenty to balance 16 threads, and each
item's five streams stay short enough for the hardware prefetchers to follow."""

_compile_lock = threading.Lock()


@functools.cache
def _numba_available() -> bool:
    try:
        import numba  # noqa: F401
    except Exception:  # ImportError, or a numba/llvmlite/numpy version mismatch raising on import
        return False
    return True


# The kernel, as plain Python until ``_kernels`` compiles it. It lives at module level (not in a closure)
# so numba's on-disk cache can key it by file and name: a closure over jitted helpers gets a fresh cache
# key, and a fresh cache file, in every process. ``_fma32``, ``_as_fp32``, ``_update_block`` and
# ``_prange`` are rebound to numba objects by ``_kernels`` before the first compile; until then they are
# pure-Python stand-ins that only document what the compiled versions do.


def _fma32(a, b, c):  # pragma: no cover - replaced by an llvm.fma intrinsic
    """fp32 ``a*b + c`` with one rounding."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _as_fp32(x):  # pragma: no cover - replaced by an intrinsic
    """A gradient element as fp32: a bf16's raw uint16 bits are the top half of the fp32's (exact)."""
    if isinstance(x, np.uint16):
        return np.array(np.uint32(x) << np.uint32(16)).view(np.float32)[()]
    return np.float32(x)


_prange = range


def _adam_py(gi, mi, vi, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step):
    """One element's AdamW moments and parameter step (the part after weight decay), in fp32."""
    base = gi if large else mi
    mi = _fma32(coeff, gi - mi, base)
    vi = _fma32(one_minus_beta2 * gi, gi, vi * beta2)
    denom = np.sqrt(vi) / bc2_sqrt + eps
    return mi, vi, (neg_step * mi) / denom


_adam = _adam_py


def _update_block_py(p, g, m, v, scale, decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step):
    """Update one block in place: same-length slices, ``g`` fp32 or bf16-as-uint16, all math in fp32.

    The gradient applied is ``g * scale`` (fp32, one rounding; exact when ``scale`` is 1), the product
    ``_correct_block_py`` forms as ``gi * applied``. The loop runs over slices from index 0 so LLVM can prove
    the indices non-negative, drop numba's negative-index wraparound and vectorise (with ``start + j``
    indexing it stays scalar).
    """
    for j in range(p.shape[0]):
        gi = _as_fp32(g[j]) * scale
        mi, vi, step = _adam(gi, m[j], v[j], coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step)
        p[j] = p[j] * decay + step
        m[j] = mi
        v[j] = vi


_update_block = _update_block_py


def _adamw_py(p, g, m, v, scale, decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step):
    """The whole range, block by block across numba's threads."""
    n = p.shape[0]
    for b in _prange((n + BLOCK - 1) // BLOCK):
        s = b * BLOCK
        e = min(s + BLOCK, n)
        _update_block(
            p[s:e], g[s:e], m[s:e], v[s:e], scale, decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step
        )


def _correct_block_py(
    p,
    g,
    m,
    v,
    applied,
    redo,
    new_coeff,
    first,
    undo_decay,
    coeff,
    large,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    bc2_sqrt,
    eps,
    neg_step,
):
    """Take back one AdamW update that applied ``applied * g`` and, with ``redo``, apply it again with
    ``new_coeff * g``: clipping's correction (slide_core/optim/adamw_correction.py) in one pass, fp32 math
    mirroring ``AdamWCorrection``'s torch ops (the moments' reversal is exact up to rounding)."""
    for j in range(p.shape[0]):
        gi = _as_fp32(g[j])
        gs = gi * applied
        mi = m[j]
        vi = v[j]
        pi = p[j] + (-neg_step * mi) / (np.sqrt(vi) / bc2_sqrt + eps)
        if first:
            mi = np.float32(0.0)
            vi = np.float32(0.0)
        else:
            mi = (mi - one_minus_beta1 * gs) / beta1  # division, as torch's div_: not * (1 / beta1)
            vi = max(_fma32(-one_minus_beta2 * gs, gs, vi) / beta2, np.float32(0.0))
        if redo:
            mi, vi, step = _adam(gi * new_coeff, mi, vi, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step)
            pi = pi + step
        else:
            pi = pi / undo_decay
        p[j] = pi
        m[j] = mi
        v[j] = vi  # fmt: skip


_correct_block = _correct_block_py


def _correct_py(
    p,
    g,
    m,
    v,
    applied,
    redo,
    new_coeff,
    first,
    undo_decay,
    coeff,
    large,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    bc2_sqrt,
    eps,
    neg_step,
):
    """The whole range, block by block across numba's threads."""
    n = p.shape[0]
    for b in _prange((n + BLOCK - 1) // BLOCK):
        s = b * BLOCK
        e = min(s + BLOCK, n)
        _correct_block(
            p[s:e], g[s:e], m[s:e], v[s:e], applied, redo, new_coeff, first, undo_decay, coeff, large, beta1,
            one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step,
        )  # fmt: skip


@functools.cache
def _kernels() -> Any:
    """Import numba and build the kernel (compiled, or loaded from numba's disk cache, per grad dtype on
    first call).

    ``cache=True`` stores the machine code in ``__pycache__`` next to this file (numba falls back to a
    per-user cache directory when that is read-only), so only the first process on a machine pays the
    few seconds of LLVM compile.
    """
    global _adam, _as_fp32, _fma32, _prange, _update_block, _correct_block
    import numba
    from llvmlite import ir as llvm_ir
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def fma32(typingctx, a, b, c):
        """A true fused multiply-add (``llvm.fma``), the single rounding torch's CPU kernels do."""
        sig = a(a, b, c)

        def codegen(context, builder, signature, args):
            t = args[0].type
            fn = builder.module.declare_intrinsic("llvm.fma", [t], llvm_ir.FunctionType(t, [t, t, t]))
            return builder.call(fn, args)

        return sig, codegen

    @intrinsic
    def as_fp32(typingctx, x):
        """uint16 (bf16 bits) -> zext, shl 16, bitcast to fp32 in registers; fp32 -> itself.

        numba has no scalar bitcast; doing it in LLVM IR keeps the bf16 path one vectorised loop with no
        staging buffer (the block-buffer alternative measured ~20% slower)."""
        if x == types.uint16:

            def codegen(context, builder, signature, args):
                bits = builder.shl(
                    builder.zext(args[0], llvm_ir.IntType(32)), llvm_ir.Constant(llvm_ir.IntType(32), 16)
                )
                return builder.bitcast(bits, llvm_ir.FloatType())

            return types.float32(x), codegen
        if x == types.float32:
            return types.float32(x), lambda context, builder, signature, args: args[0]
        return None

    _fma32, _as_fp32, _prange = fma32, as_fp32, numba.prange
    _adam = numba.njit(inline="always", fastmath=False, nogil=True)(_adam_py)
    _update_block = numba.njit(inline="always", fastmath=False, nogil=True)(_update_block_py)
    _correct_block = numba.njit(inline="always", fastmath=False, nogil=True)(_correct_block_py)

    class Kernels:
        adamw = numba.njit(parallel=True, fastmath=False, nogil=True, cache=True)(_adamw_py)
        correct = numba.njit(parallel=True, fastmath=False, nogil=True, cache=True)(_correct_py)
        set_num_threads = staticmethod(numba.set_num_threads)
        get_num_threads = staticmethod(numba.get_num_threads)
        max_threads = numba.config.NUMBA_NUM_THREADS

    return Kernels


def _np(t: torch.Tensor, name: str) -> np.ndarray:
    if t.device.type != "cpu":
        raise ValueError(f"FusedAdamW runs on host tensors, got {name} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"FusedAdamW needs contiguous ranges, {name} is not")
    return t.detach().numpy()


class FusedAdamW(Optimizer):
    """AdamW (decoupled weight decay, applied only to ranges flagged ``decay``) as one numba kernel.

    ``grad`` may be bf16 (read as raw 16-bit words, never materialised in fp32), fp32, or any other float
    dtype (cast into a reserved fp32 scratch first, like ``TorchAdamW``). ``grad_scale`` is applied in
    registers, never through a scaled copy. ``threads`` caps numba's worker count for this optimizer's calls
    (default: all of numba's threads, i.e. every core).
    """

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, config: AdamWConfig, *, threads: int | None = None) -> None:
        super().__init__(config)
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._reserved = 0
        self._off_host: TorchAdamW | None = None
        self._correction = AdamWCorrection(config)

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
        with _compile_lock:
            kernels = _kernels()
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
        for dtype in (torch.bfloat16, torch.float32):
            FusedAdamW(config, threads=self.threads).step(
                master, torch.ones(3, dtype=dtype), state, lr=1e-3, step=1, decay=True
            )

    def step(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
        grad_scale: float = 1.0,
    ) -> None:
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        n = master.numel()
        if not (grad.numel() == exp_avg.numel() == exp_avg_sq.numel() == n):
            raise ValueError(
                f"range sizes differ: master {n}, grad {grad.numel()}, "
                f"exp_avg {exp_avg.numel()}, exp_avg_sq {exp_avg_sq.numel()}"
            )
        for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if t.dtype != torch.float32:
                raise ValueError(f"{name} must be fp32, got {t.dtype}")
        if n == 0:
            return
        if master.device.type != "cpu":
            self._device_fallback().step(master, grad, state, lr=lr, step=step, decay=decay, grad_scale=grad_scale)
            return
        kernels = self._kernels()
        cfg = self.config
        f32 = np.float32
        # Scalars exactly as torch.optim.AdamW forms them: Python float64, then rounded to fp32 by the op.
        weight_decay = cfg.weight_decay if decay else 0.0
        decay_factor = f32(1 - lr * weight_decay) if weight_decay != 0 else f32(1.0)
        weight = f32(1 - cfg.beta1)  # lerp's weight, as an fp32 opmath scalar
        large = not abs(weight) < f32(0.5)
        coeff = weight - f32(1.0) if large else weight  # torch's vectorised lerp: fmadd(coeff, end - self, base)
        bias_correction1 = 1 - cfg.beta1**step
        bias_correction2_sqrt = (1 - cfg.beta2**step) ** 0.5
        args = (
            decay_factor,
            f32(coeff),
            large,
            f32(cfg.beta2),
            f32(1 - cfg.beta2),
            f32(bias_correction2_sqrt),
            f32(cfg.eps),
            f32(-(lr / bias_correction1)),
        )
        p, m, v = _np(master, "master"), _np(exp_avg, "exp_avg"), _np(exp_avg_sq, "exp_avg_sq")
        if grad.dtype == torch.bfloat16:
            g = _np(grad.view(torch.int16), "grad").view(np.uint16)  # raw bits; widened in registers
        else:
            if grad.dtype != torch.float32:
                if self._scratch.numel() < n:
                    self._scratch = torch.empty(max(n, self._reserved), dtype=torch.float32)
                grad = self._scratch[:n].copy_(grad)
            g = _np(grad, "grad")
        # One kernel for every scale: multiplying by 1.0f is exact, and the scale is always an fp32 scalar,
        # so the compiled (and cached) signatures are the same two as without clipping (bf16, fp32 grads).
        kernels.adamw(p, g, m, v, f32(grad_scale), *args)

    def correct(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        applied: Coefficient,
        correction: Correction,
        lr: float,
        step: int,
        decay: bool,
    ) -> None:
        """One pass over a host range (``fused_correct``), the torch ops elsewhere (AdamWCorrection)."""
        self._correction.apply(correction, master, grad, applied, state, lr=lr, step=step, decay=decay)


def best_adamw(config: AdamWConfig, *, threads: int | None = None, warmup: bool = True) -> Optimizer:
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


def fused_correct(
    config: AdamWConfig,
    master: torch.Tensor,
    grad: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    *,
    applied: float,
    new_coeff: float | None,
    lr: float,
    step: int,
    decay: bool,
) -> bool:
    """Clipping's correction of one host range in one pass (see ``_correct_block_py``); ``new_coeff``
    None takes the update back. Returns False (nothing done) when numba is not available, so the caller
    falls back to the torch ops."""
    if not _numba_available() or master.device.type != "cpu":
        return False
    if grad.dtype not in (torch.bfloat16, torch.float32):
        return False
    kernels = _kernels()
    g = _np(grad.view(torch.uint16) if grad.dtype == torch.bfloat16 else grad, "grad")
    f32 = np.float32
    weight_decay = config.weight_decay if decay else 0.0
    w = 1.0 - config.beta1
    large = w >= 0.5
    kernels.correct(
        _np(master, "master"), g, _np(state["exp_avg"], "exp_avg"), _np(state["exp_avg_sq"], "exp_avg_sq"),
        f32(applied), new_coeff is not None, f32(new_coeff if new_coeff is not None else 1.0), step == 1,
        f32(1.0 - lr * weight_decay), f32(w - 1.0 if large else w), large, f32(config.beta1), f32(w),
        f32(config.beta2), f32(1.0 - config.beta2), f32(math.sqrt(1.0 - config.beta2**step)), f32(config.eps),
        f32(-lr / (1.0 - config.beta1**step)),
    )  # fmt: skip
    return True
