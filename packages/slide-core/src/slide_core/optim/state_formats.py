"""How AdamW's two moments are stored between steps: ``fp32`` (exact), ``bf16`` or ``int8``.

Why: the host optimizer is memory-bound. With fp32 moments a step moves 26 bytes per parameter (bf16
gradient 2, master / exp_avg / exp_avg_sq read + write 3 x 8); bf16 moments make it 18, int8 ones about 14,
and the host holds 4 (bf16) or about 6 (int8) bytes per parameter less. The arithmetic of the step stays
fp32: a compact moment is widened in registers, updated exactly as the fp32 path updates it, and only the
value written back is rounded.

Rounding is **stochastic** (SR), never to nearest: ``exp_avg_sq`` shrinks by ``beta2 = 0.999`` per step, a
relative change far below bf16's half-ulp (2^-9), so round-to-nearest would freeze it; SR keeps every
stored value an unbiased estimate of the fp32 one. Its random bits come from a counter-based hash of
``(seed, step, element index)`` (:func:`stream_key`, :func:`element_bits`): no RNG state, so a run, its
resume and any thread count or blocking give the same bits. The index is the element's position in the
master slab, so the same element gets the same bits wherever its state is staged (RAM or NVMe). One 32-bit
hash serves both moments: its low 16 bits round ``exp_avg``, its high 16 bits ``exp_avg_sq``.

``bf16``: the fp32 bit pattern plus 16 random bits, truncated to the top 16 (unbiased between the two
neighbouring bf16 values; a value that is not finite, or whose rounding would overflow to Inf, is truncated).
``exp_avg_sq`` stays >= 0 and finite because SR never crosses zero or leaves the finite range.

``int8``: blocks of :data:`QUANT_BLOCK` = 64 elements (the unit layout's alignment, so every range the
engine hands the optimizer starts on a block) share one fp32 scale, the block's largest magnitude, computed
from the block's new fp32 values before any is encoded. Each element stores ``x / scale`` (in [0, 1]) as an
8-bit float relative to it:

- ``exp_avg`` (int8, sign and magnitude code in [-120, 120]): 4 exponent bits and 3 mantissa bits,
  normal codes 8..120 cover [2^-14, 1] with 12.5 % relative steps, codes 0..7 are linear below 2^-14
  (gradual underflow to exactly 0).
- ``exp_avg_sq`` (uint8, code in [0, 240]): 4 exponent and 4 mantissa bits, normal codes 16..240 over
  [2^-14, 1] with 6.25 % steps, codes 0..15 linear below. A positive value never rounds to 0 (it rounds up
  to the smallest code instead): a zero second moment under a non-zero first one would divide by ``eps``
  and blow the parameter up. That bias only touches elements whose ``exp_avg_sq`` is below 2^-18 of their
  block's largest (sqrt below 1/512), where it shrinks the update (safe side).

A float code is used instead of linear int8 because both moments span orders of magnitude within a block:
linear codes would round most of a block's small elements to zero.

Each format is a :class:`MomentCodec` (:func:`moment_codec` by name): the optimizer resolves its codec
once and asks it for the arrays, the widening and the rounding, so no code compares format names. Each
encoder here has twins: a plain-Python hash (:func:`mix32`, :func:`element_bits`), a torch version
(any device; the reference, and the path without numba) and scalar numba intrinsics the fused kernels
inline (slide_core/optim/_moment_intrinsics.py, used by slide_core/optim/compact_adamw.py). All are written from the same
integer recipe, so given the same fp32 moments they give the same codes (tested bit for bit).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch

__all__ = [
    "QUANT_BLOCK",
    "STATE_FORMATS",
    "MomentCodec",
    "StateArray",
    "StateFormat",
    "StateFormatMismatch",
    "checkpoint_arrays",
    "checkpoint_bytes",
    "checkpoint_state_format",
    "codec_scratch_bytes",
    "decode_moments",
    "element_bits",
    "encode_moments",
    "mix32",
    "moment_codec",
    "refuse_other_state_format",
    "slice_state",
    "state_arrays",
    "state_bytes_per_param",
    "stream_key",
]

StateFormat = Literal["fp32", "bf16", "int8"]
STATE_FORMATS: tuple[str, ...] = ("fp32", "bf16", "int8")
QUANT_BLOCK = 64
"""Elements per int8 scale: the unit layout's alignment (``_ALIGN_NUMEL``), so unit starts, the decay
prefix's end and every unit's end fall on a block boundary and no two optimizer calls share a block."""

STEP_SALT = 0
"""Hash stream of an update (``Optimizer.step``)."""
CORRECTION_SALT = 1
"""Hash stream of clipping's correction of an update, so it never reuses the update's bits."""

_M32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B  # lowbias32 (Chris Wellons' hash prospector), a full-avalanche 32-bit mix
_INT8_M_BIAS = 112 << 3  # fp32 exponent 112 (2^-15) in the (exponent, 3-bit mantissa) code of exp_avg
_INT8_V_BIAS = 112 << 4  # ... and in the (exponent, 4-bit mantissa) code of exp_avg_sq
_INT8_M_MAX = 120  # 1.0: exponent 127, mantissa 0
_INT8_V_MAX = 240


@dataclass(frozen=True)
class StateArray:
    """One optimizer state array: its name, dtype and how many parameters share one of its entries (1 for
    per-element arrays, :data:`QUANT_BLOCK` for int8 block scales)."""

    name: str
    dtype: torch.dtype = torch.float32
    per_entry: int = 1

    def numel(self, params: int) -> int:
        """Entries for ``params`` parameters (a multiple of ``per_entry`` unless it is a unit's tail)."""
        return -(-params // self.per_entry)

    def range(self, lo: int, hi: int) -> slice:
        """The entries of parameters ``[lo, hi)``; ``lo`` must start an entry."""
        if lo % self.per_entry:
            raise ValueError(
                f"{self.name}: int8 optimizer state needs ranges that start on a {self.per_entry}-element block, "
                f"got {lo}"
            )
        return slice(lo // self.per_entry, -(-hi // self.per_entry))


def state_arrays(state_format: str, names: Sequence[str] = ("exp_avg", "exp_avg_sq")) -> tuple[StateArray, ...]:
    """The arrays AdamW's moments ``names`` are stored in under ``state_format``."""
    return moment_codec(state_format).arrays(names)


def checkpoint_arrays(state: Sequence[StateArray]) -> tuple[StateArray, ...]:
    """The arrays of a checkpoint, in file order: the fp32 master, then the optimizer's ``state`` arrays as it
    stores them. ``Engine.checkpoint_arrays`` writes exactly these, and planners price them with
    :func:`checkpoint_bytes`, so a plan's checkpoint size is the size of the files."""
    return (StateArray("master"), *state)


def checkpoint_bytes(arrays: Sequence[StateArray], unit_numels: Sequence[int]) -> int:
    """Bytes of the array files of one checkpoint of units of ``unit_numels`` (``state.json`` aside, a few
    KiB): each array holds ``array.numel(n)`` entries per unit, as ``StateSource`` counts them."""
    return sum(array.numel(numel) * array.dtype.itemsize for array in arrays for numel in unit_numels)


def state_bytes_per_param(state_format: str) -> float:
    """Host bytes per parameter of the two moments (int8: codes plus the block scales)."""
    return moment_codec(state_format).bytes_per_param()


def slice_state(
    arrays: Sequence[StateArray], views: Mapping[str, torch.Tensor], lo: int, hi: int
) -> dict[str, torch.Tensor]:
    """Parameters ``[lo, hi)`` of every state view (``views`` cover one range that starts on a block)."""
    return {a.name: views[a.name][a.range(lo, hi)] for a in arrays}


# -- the hash: Python integers (the twin the kernels are checked against) ----------------------------------
def mix32(x: int) -> int:
    """A 32-bit integer finaliser: every output bit depends on every input bit."""
    x &= _M32
    x ^= x >> 16
    x = (x * _M1) & _M32
    x ^= x >> 15
    x = (x * _M2) & _M32
    x ^= x >> 16
    return x


def stream_key(seed: int, step: int, salt: int = STEP_SALT) -> tuple[int, int]:
    """The two 32-bit keys of one update's hash stream (computed once per call, on the host)."""
    a = mix32((seed & _M32) ^ 0x243F6A88)
    a = mix32(a ^ ((seed >> 32) & _M32))
    b = mix32(a ^ (step & _M32))
    b = mix32(b ^ ((step >> 32) & _M32))
    k0 = mix32(b ^ (salt & _M32))
    return k0, mix32(k0 ^ 0x85A308D3)


def element_bits(index: int, k0: int, k1: int) -> int:
    """32 random bits for the element at master-slab position ``index`` (low half: exp_avg, high: exp_avg_sq)."""
    return mix32(mix32((index & _M32) ^ k0) ^ ((index >> 32) & _M32) ^ k1)


# -- torch twins (any device) ------------------------------------------------------------------------------
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for int64 ``x`` in [0, 2^32) without int64 overflow (16-bit halves of ``c``)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def _bits_t(index0: int, numel: int, key: tuple[int, int], device: torch.device) -> torch.Tensor:
    """:func:`element_bits` of ``index0 + arange(numel)`` as int64 in [0, 2^32)."""
    index = torch.arange(index0, index0 + numel, dtype=torch.int64, device=device)
    k0, k1 = key
    return _mix32_t(_mix32_t((index & _M32) ^ k0) ^ ((index >> 32) & _M32) ^ k1)


def _u32(x: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor's bit patterns as int64 in [0, 2^32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & _M32


def _f32(bits: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns in [0, 2^32) as fp32."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def _sr_bf16_t(x: torch.Tensor, rand16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 with stochastic rounding by ``rand16`` (int64 in [0, 2^16))."""
    u = _u32(x)
    up = (u + rand16) >> 16
    trunc = u >> 16
    nonfinite = (u & 0x7F800000) == 0x7F800000
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    overflow = (up & 0x7F80) == 0x7F80
    out = torch.where(nonfinite | overflow, trunc, up)
    out = torch.where(nan, trunc | 0x0040, out)  # NaN stays a (quiet) NaN
    return torch.where(out >= 2**15, out - 2**16, out).to(torch.int16).view(torch.bfloat16)


def _block_scale_t(x: torch.Tensor) -> torch.Tensor:
    return x.abs().view(-1, QUANT_BLOCK).amax(dim=1)


def _encode_int8_t(
    x: torch.Tensor, scale: torch.Tensor, rand16: torch.Tensor, mantissa_bits: int, keep_positive: bool
) -> torch.Tensor:
    """Codes (int64, magnitude) of ``|x| / scale`` in the 8-bit float with ``mantissa_bits``; see the module."""
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    r = (x.abs().view(-1, QUANT_BLOCK) * inv[:, None]).reshape(-1).clamp_(max=1.0)
    u = _u32(r)
    shift = 23 - mantissa_bits
    bias = 112 << mantissa_bits
    normal = ((u + (rand16 << (shift - 16))) >> shift) - bias
    fixed = (r * float(2 ** (14 + mantissa_bits + 16))).to(torch.int64)  # grid steps x 2^16, truncated
    low = (fixed + rand16) >> 16
    if keep_positive:
        low = torch.where((x > 0) & (low == 0), torch.ones_like(low), low)
    return torch.where(u >= (113 << 23), normal, low)


def _decode_int8_t(mag: torch.Tensor, scale: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    normals = mag >= (1 << mantissa_bits)
    bits = (mag + (112 << mantissa_bits)) << (23 - mantissa_bits)
    r = torch.where(normals, _f32(bits), mag.to(torch.float32) * float(2.0 ** -(14 + mantissa_bits)))
    return (r.view(-1, QUANT_BLOCK) * scale[:, None]).reshape(-1)


def decode_moments(
    state_format: str, state: Mapping[str, torch.Tensor], out_m: torch.Tensor, out_v: torch.Tensor
) -> None:
    """Widen one range's stored moments into fp32 ``out_m`` / ``out_v`` (exact for fp32 and bf16)."""
    moment_codec(state_format).decode(state, out_m, out_v)


def encode_moments(
    state_format: str,
    m: torch.Tensor,
    v: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    *,
    index0: int,
    key: tuple[int, int],
) -> None:
    """Store fp32 moments ``m`` / ``v`` of one range into ``state`` (its format's arrays), rounding
    stochastically with the hash stream ``key`` from slab position ``index0`` on."""
    moment_codec(state_format).encode(m, v, state, index0=index0, key=key)


def codec_scratch_bytes(state_format: str, numel: int) -> int:
    """Peak bytes of the temporaries the torch twins allocate to encode (or decode: less) one range of
    ``numel`` (:meth:`MomentCodec.scratch_bytes`)."""
    return moment_codec(state_format).scratch_bytes(numel)


# -- the codecs ------------------------------------------------------------------------------------------
class MomentCodec(ABC):
    """How AdamW's two moments are stored: the arrays, and the torch ops that widen them to fp32 and
    round fp32 back into them. Stateless: one instance per format serves every optimizer and thread."""

    name: ClassVar[StateFormat]
    block: ClassVar[int] = 1
    """Parameters whose moments are encoded together (int8: a block shares a scale): every range an
    optimizer is handed must start on a multiple of it."""

    @abstractmethod
    def arrays(self, names: Sequence[str] = ("exp_avg", "exp_avg_sq")) -> tuple[StateArray, ...]:
        """The arrays the moments ``names`` are stored in."""

    def bytes_per_param(self) -> float:
        """Host bytes per parameter of the two moments (int8: codes plus the block scales)."""
        return sum(a.dtype.itemsize / a.per_entry for a in self.arrays())

    def decode(self, state: Mapping[str, torch.Tensor], out_m: torch.Tensor, out_v: torch.Tensor) -> None:
        """Widen one range's stored moments into fp32 ``out_m`` / ``out_v`` (a plain copy, exact for fp32
        and bf16; int8 scales its codes)."""
        out_m.copy_(state["exp_avg"])
        out_v.copy_(state["exp_avg_sq"])

    @abstractmethod
    def encode(
        self,
        m: torch.Tensor,
        v: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        index0: int,
        key: tuple[int, int],
    ) -> None:
        """Store fp32 moments ``m`` / ``v`` of one range into ``state``, rounding stochastically with the
        hash stream ``key`` from slab position ``index0`` on."""

    @abstractmethod
    def scratch_bytes(self, numel: int) -> int:
        """Peak bytes of the temporaries the torch twins allocate to encode (or decode: less) one range of
        ``numel``: the hash's int64 lanes, the rounding's bit patterns, int8's per-block scales. The twins
        are written as plain tensor expressions, so this grows with the range: callers bound it by passing
        chunks (``CompactAdamW``'s torch path). Counted op by op with ``slide_core.alloc_counter``
        (tests/core/test_compact_state.py holds these numbers to the count)."""


class Fp32Moments(MomentCodec):
    """fp32 moments, stored as they are (exact)."""

    name = "fp32"

    def arrays(self, names: Sequence[str] = ("exp_avg", "exp_avg_sq")) -> tuple[StateArray, ...]:
        m, v = names
        return (StateArray(m), StateArray(v))

    def encode(
        self,
        m: torch.Tensor,
        v: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        index0: int,
        key: tuple[int, int],
    ) -> None:
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)

    def scratch_bytes(self, numel: int) -> int:
        return 0


class Bf16Moments(MomentCodec):
    """bf16 moments, rounded stochastically (decoding is exact)."""

    name = "bf16"

    def arrays(self, names: Sequence[str] = ("exp_avg", "exp_avg_sq")) -> tuple[StateArray, ...]:
        m, v = names
        return (StateArray(m, torch.bfloat16), StateArray(v, torch.bfloat16))

    def encode(
        self,
        m: torch.Tensor,
        v: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        index0: int,
        key: tuple[int, int],
    ) -> None:
        bits = _bits_t(index0, m.numel(), key, m.device)
        rand_m, rand_v = bits & 0xFFFF, bits >> 16
        state["exp_avg"].copy_(_sr_bf16_t(m, rand_m))
        state["exp_avg_sq"].copy_(_sr_bf16_t(v, rand_v))

    def scratch_bytes(self, numel: int) -> int:
        return 76 * numel  # encode; decode is a copy


class Int8Moments(MomentCodec):
    """8-bit float codes against one fp32 scale per :data:`QUANT_BLOCK` elements (see the module)."""

    name = "int8"
    block = QUANT_BLOCK

    def arrays(self, names: Sequence[str] = ("exp_avg", "exp_avg_sq")) -> tuple[StateArray, ...]:
        m, v = names
        return (
            StateArray(m, torch.int8),
            StateArray(v, torch.uint8),
            StateArray(f"{m}_scale", torch.float32, QUANT_BLOCK),
            StateArray(f"{v}_scale", torch.float32, QUANT_BLOCK),
        )

    def decode(self, state: Mapping[str, torch.Tensor], out_m: torch.Tensor, out_v: torch.Tensor) -> None:
        m, v = state["exp_avg"], state["exp_avg_sq"]
        _check_blocks(m.numel())
        signed = m.to(torch.int64)
        magnitude = _decode_int8_t(signed.abs(), state["exp_avg_scale"], 3)
        out_m.copy_(torch.where(signed < 0, -magnitude, magnitude))
        out_v.copy_(_decode_int8_t(v.to(torch.int64), state["exp_avg_sq_scale"], 4))

    def encode(
        self,
        m: torch.Tensor,
        v: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        index0: int,
        key: tuple[int, int],
    ) -> None:
        bits = _bits_t(index0, m.numel(), key, m.device)
        rand_m, rand_v = bits & 0xFFFF, bits >> 16
        _check_blocks(m.numel())
        m_scale, v_scale = _block_scale_t(m), _block_scale_t(v)
        magnitude = _encode_int8_t(m, m_scale, rand_m, 3, keep_positive=False)
        state["exp_avg"].copy_(torch.where(m < 0, -magnitude, magnitude))
        state["exp_avg_sq"].copy_(_encode_int8_t(v, v_scale, rand_v, 4, keep_positive=True))
        state["exp_avg_scale"].copy_(m_scale)
        state["exp_avg_sq_scale"].copy_(v_scale)

    def scratch_bytes(self, numel: int) -> int:
        return 85 * numel + 12 * -(-numel // QUANT_BLOCK)  # encode; decode 46 B per element


_CODECS: tuple[MomentCodec, ...] = (Fp32Moments(), Bf16Moments(), Int8Moments())


def moment_codec(state_format: str) -> MomentCodec:
    """The codec of the format named ``state_format`` (``fp32``, ``bf16`` or ``int8``)."""
    for codec in _CODECS:
        if codec.name == state_format:
            return codec
    raise ValueError(f"optimizer state format must be one of {', '.join(STATE_FORMATS)}, got {state_format!r}")


def _check_blocks(numel: int) -> None:
    if numel % QUANT_BLOCK:
        raise ValueError(f"int8 optimizer state works on whole {QUANT_BLOCK}-element blocks, got a range of {numel}")


def checkpoint_state_format(path: Path) -> str | None:
    """The optimizer state format a checkpoint directory was written with, read from the dtype of its
    ``exp_avg`` array (None when it lists none, e.g. a data-parallel manifest of format 2); every
    checkpoint records it so, fp32 ones from before compact formats existed included."""
    from slide_core.checkpoint import CheckpointCorrupt, read_state

    try:
        state = read_state(path)
    except CheckpointCorrupt:  # loading it names the fault
        return None
    meta = state["arrays"].get("exp_avg") if "arrays" in state else state["files"].get("exp_avg.bin")
    if not isinstance(meta, dict):
        return None
    return _FORMAT_OF_DTYPE.get(str(meta.get("dtype")))


class StateFormatMismatch(ValueError):
    """A checkpoint's optimizer state is in another format than the run resuming it."""


def refuse_other_state_format(path: Path, state_format: str) -> None:
    """Raise :class:`StateFormatMismatch` (one line) when the checkpoint at ``path`` holds another state
    format: the moments cannot be carried across formats without changing the run."""
    saved = checkpoint_state_format(path)
    if saved is not None and saved != state_format:
        raise StateFormatMismatch(
            f"checkpoint {path} holds {saved} optimizer state; this run uses {state_format}: resume it with "
            f"optimizer state {saved}"
        )


_FORMAT_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}
