"""The split master (slide_core/split_master.py): the format's claims checked over every low pattern, and
the optimizers stepping a split range exactly as they step the fp32 one.

Against plain torch: ``hi`` must be ``fp32.to(torch.bfloat16)``, bit for bit; every non-NaN fp32 pattern
must come back bit for bit; a NaN must come back a NaN. Against the fp32 master: FusedAdamW's split kernel
(decode in registers, the same fp32 arithmetic, encode) and TorchAdamW's decode-step-encode must leave
decoded masters and moments bit-identical to the same optimizer on the fp32 range.
"""

from __future__ import annotations

import pytest
import torch

from slide_core import AdamWConfig
from slide_core.optim import TorchAdamW
from slide_core.optimizer import Correction
from slide_core.split_master import MIDPOINT, SplitMaster, tie_bytes

UPPERS = (
    0x0000,  # +0 and the smallest positive subnormals
    0x0001,
    0x0002,
    0x007F,  # the largest subnormals
    0x0080,  # the smallest normals
    0x3F80,  # 1.0
    0x3F81,
    0x7F7E,
    0x7F7F,  # max finite (rounds up to inf above the midpoint)
    0x7F80,  # +inf, and NaNs below it
    0x7FC0,  # quiet NaNs
    0x8000,  # -0 and negative subnormals
    0x8001,
    0x807F,
    0x8080,
    0xBF80,  # -1.0
    0xFF7F,  # -max finite
    0xFF80,  # -inf
    0xFFC0,
    0x1234,
    0xABCD,
)


def _patterns() -> torch.Tensor:
    """Every low 16-bit pattern under each of ``UPPERS``, as fp32 values."""
    low = torch.arange(1 << 16, dtype=torch.int64)
    bits = torch.cat([(upper << 16) | low for upper in UPPERS])
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _split(values: torch.Tensor, offset: int = 0) -> SplitMaster:
    n = values.numel()
    master = SplitMaster(
        torch.empty(n, dtype=torch.bfloat16),
        torch.empty(n, dtype=torch.int16),
        torch.zeros(tie_bytes(offset + n), dtype=torch.uint8),
        offset,
    )
    master.encode_(values)
    return master


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-identical, except that any NaN matches any NaN."""
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan])


@pytest.mark.parametrize("offset", [0, 5, 4093])
def test_every_low_pattern_round_trips(offset):
    values = _patterns()
    master = _split(values, offset)
    nan = values.isnan()
    assert torch.equal(master.hi.view(torch.int16)[~nan], values.to(torch.bfloat16).view(torch.int16)[~nan])
    assert master.hi[nan].isnan().all()
    assert torch.equal(master.lo, values.view(torch.int16).view(-1, 2)[:, 0])
    assert _same_bits(master.decode(), values)


def test_sixteen_low_bits_alone_are_ambiguous_at_the_midpoint():
    """Why the tie bit exists: both midpoints around an even bf16 H round to H and share lo = 0x8000."""
    for even in (0x3F80, 0x0002, 0x8002, 0xBF80, 0x7F7E):
        below = torch.tensor([((even - 1) << 16) | 0x8000], dtype=torch.int64)
        at = torch.tensor([(even << 16) | 0x8000], dtype=torch.int64)
        pair = torch.cat([below, at])
        values = torch.where(pair >= 1 << 31, pair - (1 << 32), pair).to(torch.int32).view(torch.float32)
        hi = values.to(torch.bfloat16).view(torch.int16)
        assert hi[0] == hi[1] and (int(hi[0]) & 0xFFFF) == even
        master = _split(values)
        assert torch.equal(master.lo, torch.full((2,), MIDPOINT, dtype=torch.int16))
        assert torch.equal(master.decode().view(torch.int32), values.view(torch.int32))


def test_neighbouring_ranges_keep_each_others_tie_bits():
    """Ranges that meet inside a tie byte: encoding one leaves the other's bits alone."""
    values = _patterns()[: 8 * 64].clone()
    bits = values.view(torch.int32)
    bits.copy_((bits & ~0xFFFF) | 0x8000)  # every element a midpoint
    bits[::2] |= 0x10000  # odd uppers: these round up, the others do not
    for cut in (1, 5, 13, 200):
        master = _split(torch.zeros_like(values), offset=3)
        master.ties.fill_(0xA5)
        left, right = master[:cut], master[cut:]
        left.encode_(values[:cut])
        right.encode_(values[cut:])
        assert torch.equal(master.decode().view(torch.int32), bits)
        right.encode_(torch.zeros_like(values[cut:]))
        assert torch.equal(left.decode().view(torch.int32), bits[:cut])


def test_bad_planes_are_refused_in_one_line():
    with pytest.raises(ValueError, match="bf16 hi, int16 lo and uint8 ties"):
        SplitMaster(torch.zeros(3), torch.zeros(3, dtype=torch.int16), torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not cover"):
        SplitMaster(
            torch.zeros(9, dtype=torch.bfloat16), torch.zeros(9, dtype=torch.int16), torch.zeros(1, dtype=torch.uint8)
        )
    with pytest.raises(ValueError, match="contiguous slices"):
        _split(torch.zeros(8))[::2]


# -- the optimizers ---------------------------------------------------------------------------------------


def _crafted(n: int, seed: int) -> torch.Tensor:
    """Random masters with the hard cases planted: midpoints (both parities of the upper half), negative
    values, subnormals, zeros of both signs."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen) * 0.05
    bits = values.view(torch.int32)
    bits[::37] = (bits[::37] & ~0xFFFF) | 0x8000
    bits[1::74] |= 0x10000
    values[5::211] = torch.tensor(3e-39)  # subnormal
    values[7::223] = torch.tensor(-2e-40)
    values[11::401] = 0.0
    values[13::409] = -0.0
    return values


def _moments(n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    return {
        "exp_avg": torch.randn(n, generator=gen) * 0.01,
        "exp_avg_sq": torch.rand(n, generator=gen) * 1e-4,
    }


def _optimizers(config: AdamWConfig):
    optimizers = [("torch", lambda: TorchAdamW(config, fused=False)), ("torch-fused", lambda: TorchAdamW(config))]
    try:
        import numba  # noqa: F401
    except ImportError:
        return optimizers
    from slide_core.optim.fused_adamw import FusedAdamW

    return [*optimizers, ("numba", lambda: FusedAdamW(config))]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "offset"), [(1, 0), (13, 3), (9000, 4090), (40_961, 64)])
def test_split_steps_match_fp32_steps(weight_decay, grad_dtype, n, offset):
    config = AdamWConfig(weight_decay=weight_decay)
    for name, make in _optimizers(config):
        values = _crafted(n, seed=n)
        split = _split(values, offset)
        state_fp32, state_split = _moments(n, n), _moments(n, n)
        on_fp32, on_split = make(), make()
        gen = torch.Generator().manual_seed(n + 7)
        for step in range(1, 5):
            grad = torch.randn(n, generator=gen).to(grad_dtype)
            kwargs = {"lr": 1e-3, "step": step, "decay": step != 3, "grad_scale": (1.0, 0.37)[step % 2]}
            on_fp32.step(values, grad, state_fp32, **kwargs)
            on_split.step(split, grad, state_split, **kwargs)
            assert _same_bits(split.decode(), values), f"{name}: master differs after step {step}"
            for key in state_fp32:
                assert torch.equal(state_split[key], state_fp32[key]), f"{name}: {key} differs after step {step}"
        assert torch.equal(split.hi, values.to(torch.bfloat16)), name


@pytest.mark.parametrize("correction", [Correction("undo"), Correction("rescale", 0.25)])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_split_corrections_match_fp32_corrections(correction, grad_dtype):
    """Clipping's correction of an applied update (fused pass for bf16 grads, torch ops for fp16)."""
    n, offset = 20_003, 6
    config = AdamWConfig(weight_decay=0.1)
    for name, make in _optimizers(config):
        values = _crafted(n, seed=1)
        split = _split(values, offset)
        state_fp32, state_split = _moments(n, 1), _moments(n, 1)
        on_fp32, on_split = make(), make()
        grad = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(grad_dtype)
        for step in (1, 2):
            kwargs = {"lr": 1e-3, "step": step, "decay": True}
            on_fp32.step(values, grad, state_fp32, grad_scale=0.5, **kwargs)
            on_split.step(split, grad, state_split, grad_scale=0.5, **kwargs)
            on_fp32.correct(values, grad, state_fp32, applied=0.5, correction=correction, **kwargs)
            on_split.correct(split, grad, state_split, applied=0.5, correction=correction, **kwargs)
            assert _same_bits(split.decode(), values), name
            for key in state_fp32:
                assert torch.equal(state_split[key], state_fp32[key]), f"{name}: {key}"


def test_the_kernel_helpers_match_torch_on_every_pattern():
    """``_store_master`` / ``_load_master`` (what every split kernel inlines) against torch's cast and
    ``decode``, over every low pattern: hi, lo and, at the midpoints, the tie bit."""
    numba = pytest.importorskip("numba")
    from slide_core.optim import _adamw_kernels

    _adamw_kernels.kernels()  # binds the compiled helpers
    store, load = _adamw_kernels._store_master, _adamw_kernels._load_master

    @numba.njit
    def round_trip(x, hi, lo, flags, back):
        for j in range(x.shape[0]):
            hi[j], lo[j], flags[j] = store(x[j])
            back[j] = load(hi[j], lo[j], flags[j])

    values = _patterns()
    n = values.numel()
    hi, lo = torch.empty(n, dtype=torch.int16), torch.empty(n, dtype=torch.int16)
    flags, back = torch.empty(n, dtype=torch.uint8), torch.empty(n)
    round_trip(values.numpy(), hi.numpy().view("uint16"), lo.numpy().view("uint16"), flags.numpy(), back.numpy())
    nan = values.isnan()
    assert torch.equal(hi[~nan], values.to(torch.bfloat16).view(torch.int16)[~nan])
    assert hi[nan].view(torch.bfloat16).isnan().all()
    assert torch.equal(lo, values.view(torch.int16).view(-1, 2)[:, 0])
    reference = _split(values)
    midpoint = (lo == MIDPOINT) & ~nan  # a NaN's tie bit is free: it decodes to a NaN either way
    assert torch.equal(flags[midpoint].bool(), _tie_bits(reference)[midpoint])
    assert _same_bits(back, values)


def _tie_bits(master: SplitMaster) -> torch.Tensor:
    bits = (master.ties.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(-1)[master.offset : master.offset + master.numel()].bool()


def test_the_kernel_steps_every_pattern_as_fp32():
    """A real step over every low pattern (NaN and inf included) on both masters: identical; some
    elements become midpoints, so the kernel's own tie writes are read back by torch's decode."""
    pytest.importorskip("numba")
    from slide_core.optim.fused_adamw import FusedAdamW

    values = _patterns()
    n = values.numel()
    split = _split(values, offset=1)
    before = split.lo == MIDPOINT
    states = [_moments(n, 3), _moments(n, 3)]
    grad = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    config = AdamWConfig(weight_decay=0.01)
    for target, state in zip((values, split), states, strict=True):
        FusedAdamW(config).step(target, grad, state, lr=1e-2, step=3, decay=True)
    assert _same_bits(split.decode(), values)
    assert torch.equal(states[0]["exp_avg"], states[1]["exp_avg"])
    new_midpoints = (split.lo == MIDPOINT) & ~before
    assert int(new_midpoints.sum()) > 0
    assert torch.equal(split.hi[~values.isnan()], values.to(torch.bfloat16)[~values.isnan()])
