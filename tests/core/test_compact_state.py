"""Compact Adam state (slide_core/optim/state_formats.py, compact_adamw.py): the hash and the stochastic
rounding against plain-Python / plain-torch references, the numba kernels against the torch path, and the
engine with bf16 and int8 moments on the CPU device."""

from __future__ import annotations

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW, build_optimizer
from slide_core.optim.compact_adamw import CompactAdamW
from slide_core.optim.fused_adamw import FusedAdamW
from slide_core.optim.state_formats import (
    QUANT_BLOCK,
    decode_moments,
    element_bits,
    encode_moments,
    mix32,
    state_arrays,
    stream_key,
)
from slide_core.testing import ToyConfig, ToyModel, load_init, toy_batches, toy_init

needs_numba = pytest.mark.skipif(not FusedAdamW.available(), reason="numba is not importable")
M32 = 0xFFFFFFFF


def _mix32_reference(x: int) -> int:
    """lowbias32, written out independently of state_formats."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits of a tensor, for bit-for-bit comparisons of any dtype."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _empty_state(state_format: str, n: int) -> dict[str, torch.Tensor]:
    return {a.name: torch.zeros(a.numel(n), dtype=a.dtype) for a in state_arrays(state_format)}


def test_hash_twins_agree() -> None:
    """The torch twin (int64 ops, used on every device) gives the Python hash's bits, also past 2^32."""
    from slide_core.optim.state_formats import _bits_t

    assert [mix32(x) for x in (0, 1, 2**31, M32)] == [_mix32_reference(x) for x in (0, 1, 2**31, M32)]
    key = stream_key(seed=1234, step=17)
    for index0 in (0, 1000, 2**32 - 5):
        got = _bits_t(index0, 10, key, torch.device("cpu")).tolist()
        assert got == [element_bits(index0 + j, *key) for j in range(10)]
    assert stream_key(1, 2) != stream_key(1, 3) != stream_key(2, 2)
    assert stream_key(1, 2, salt=1) != stream_key(1, 2)


def _encode_many(state_format: str, m: torch.Tensor, v: torch.Tensor, draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded values of ``draws`` independent encodings (one per step's hash stream)."""
    ms, vs = [], []
    out_m, out_v = torch.empty_like(m), torch.empty_like(v)
    for step in range(1, draws + 1):
        state = _empty_state(state_format, m.numel())
        encode_moments(state_format, m, v, state, index0=0, key=stream_key(5, step))
        decode_moments(state_format, state, out_m, out_v)
        ms.append(out_m.clone())
        vs.append(out_v.clone())
    return torch.stack(ms), torch.stack(vs)


@pytest.mark.parametrize("state_format", ["bf16", "int8"])
def test_stochastic_rounding_is_unbiased_and_deterministic(state_format: str) -> None:
    gen = torch.Generator().manual_seed(0)
    n = 8 * QUANT_BLOCK
    m = torch.randn(n, generator=gen) * torch.logspace(-6, -2, n)
    v = torch.rand(n, generator=gen) * torch.logspace(-12, -4, n)
    v[::97] = 0.0
    draws = 400
    ms, vs = _encode_many(state_format, m, v, draws)
    assert bool((vs >= 0).all()) and bool(torch.isfinite(vs).all()) and bool(torch.isfinite(ms).all())
    assert bool((vs[:, v == 0] == 0).all()), "an exactly zero exp_avg_sq must stay zero"
    # Every draw lies on one of the two grid points around the value: never further than their spacing.
    if state_format == "bf16":
        spacing_m = m.abs() * 2.0**-7
        spacing_v = v * 2.0**-7
    else:
        spacing_m = m.abs() * 2.0**-2 + m.abs().view(-1, QUANT_BLOCK).amax(1).repeat_interleave(QUANT_BLOCK) * 2.0**-17
        spacing_v = v * 2.0**-3 + v.view(-1, QUANT_BLOCK).amax(1).repeat_interleave(QUANT_BLOCK) * 2.0**-18
    assert bool(((ms - m).abs() <= spacing_m * 1.01).all())
    assert bool(((vs - v).abs() <= spacing_v * 1.01).all())
    # Unbiased: the mean of the draws approaches the value like sigma / sqrt(draws) (5 sigma bound).
    sigma_m = spacing_m / 2 / draws**0.5
    sigma_v = spacing_v / 2 / draws**0.5
    assert bool(((ms.mean(0) - m).abs() <= 5 * sigma_m + 1e-30).all())
    positive_floor = v >= v.view(-1, QUANT_BLOCK).amax(1).repeat_interleave(QUANT_BLOCK) * 2.0**-18
    ok = ((vs.mean(0) - v).abs() <= 5 * sigma_v + 1e-30) | ~positive_floor  # below the floor: rounded up, by design
    assert bool(ok.all())
    # Deterministic: the same key gives the same codes; another step gives other codes.
    again = _encode_many(state_format, m, v, 2)
    assert torch.equal(again[0], ms[:2]) and torch.equal(again[1], vs[:2])
    assert not torch.equal(ms[0], ms[1])


def test_bf16_rounding_keeps_special_values() -> None:
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.3895314e38, -3.3895314e38, 1e-40])
    state = _empty_state("bf16", x.numel())
    for step in range(1, 50):
        encode_moments("bf16", x, x.abs(), state, index0=0, key=stream_key(0, step))
        m = state["exp_avg"].float()
        assert m[0] == 0 and m[1] == 0 and m[2] == float("inf") and m[3] == -float("inf")
        assert torch.isnan(m[4])
        assert bool(torch.isfinite(m[5:]).all()), "a finite value never rounds to Inf"
        assert bool((state["exp_avg_sq"].float()[5:] >= 0).all())


def test_int8_positive_second_moment_never_rounds_to_zero() -> None:
    """A zero exp_avg_sq under a non-zero exp_avg would divide by eps: tiny positive values round up."""
    v = torch.full((QUANT_BLOCK,), 1e-30)
    v[0] = 1.0
    out_m, out_v = torch.empty_like(v), torch.empty_like(v)
    for step in range(1, 20):
        state = _empty_state("int8", v.numel())
        encode_moments("int8", v, v, state, index0=0, key=stream_key(0, step))
        decode_moments("int8", state, out_m, out_v)
        assert bool((out_v > 0).all())
        assert out_v[0] == 1.0 and out_m[0] == 1.0  # the block's largest value is exact


def _run_steps(optimizer, master, state, grads, *, scales=None):
    for step, grad in enumerate(grads, start=1):
        scale = 1.0 if scales is None else scales[step - 1]
        optimizer.step(master, grad, state, lr=1e-3, step=step, decay=step % 2 == 1, grad_scale=scale)


def _grads(n: int, steps: int, dtype: torch.dtype, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Gradients over several orders of magnitude inside each block, and some zeros.
    return [(torch.randn(n, generator=gen) * 1e-2 * torch.rand(n, generator=gen) ** 4).to(dtype) for _ in range(steps)]


@needs_numba
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("state_format", ["bf16", "int8"])
def test_kernel_matches_the_torch_path(state_format: str, grad_dtype: torch.dtype) -> None:
    """The numba kernel and the torch ops (``torch._fused_adamw_`` on the widened moments) do the same fp32
    arithmetic and round the same moments with the same hash: masters and stored moments bit-identical,
    so a unit's state is the same whichever side updated it (Note [Streamed updates are the host's
    arithmetic])."""
    n = 64 * 123
    config = AdamWConfig(weight_decay=0.1, state_format=state_format, state_seed=3)
    slab = torch.randn(n + 256, generator=torch.Generator().manual_seed(2)) * 0.02
    results = []
    for fused in (True, False):
        master = slab.clone()[256:]  # a range at offset 256 of its slab: the hash index starts there
        state = _empty_state(state_format, n)
        _run_steps(
            CompactAdamW(config, fused=fused), master, state, _grads(n, 5, grad_dtype), scales=[1, 1, 0.25, 1, 1]
        )
        results.append((master, state))
    (master_k, state_k), (master_t, state_t) = results
    for name in state_k:
        assert torch.equal(_bits(state_k[name]), _bits(state_t[name])), name
    assert torch.equal(_bits(master_k), _bits(master_t))


@needs_numba
def test_kernel_is_independent_of_thread_count() -> None:
    n = 64 * 200
    results = []
    for threads in (1, 2):
        config = AdamWConfig(state_format="int8", state_seed=9)
        master = torch.linspace(-1, 1, n)
        state = _empty_state("int8", n)
        _run_steps(CompactAdamW(config, threads=threads, fused=True), master, state, _grads(n, 3, torch.bfloat16))
        results.append((master, state))
    assert torch.equal(results[0][0], results[1][0])
    for name, tensor in results[0][1].items():
        assert torch.equal(tensor, results[1][1][name]), name


def _edge_case_range(
    state_format: str, n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Master, fp32 gradient and stored moments where the kernels' shortcuts could go wrong: 64-element
    blocks of zeros, of one repeated value, of subnormals (gradients, moments and int8 scales), of huge
    gradients, of a single non-zero element, and random ones spanning many orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen) * 0.02
    grad = torch.randn(n, generator=gen) * torch.logspace(-12, 2, n)[torch.randperm(n, generator=gen)]
    state = _empty_state(state_format, n)
    if state_format == "int8":
        state["exp_avg"].copy_(torch.randint(-120, 121, (n,), generator=gen, dtype=torch.int8))
        state["exp_avg_sq"].copy_(torch.randint(0, 241, (n,), generator=gen, dtype=torch.int16).to(torch.uint8))
        for name in ("exp_avg_scale", "exp_avg_sq_scale"):
            scale = state[name]
            scale.copy_(torch.rand(scale.numel(), generator=gen) * torch.logspace(-30, 0, scale.numel()))
            scale[1::5] = 1e-40  # subnormal block scales
            scale[2::7] = 0.0
    else:
        state["exp_avg"].copy_((torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16))
        state["exp_avg_sq"].copy_((torch.rand(n, generator=gen) * 1e-6).to(torch.bfloat16))
    blocks = n // QUANT_BLOCK
    for block in range(0, blocks, 6):
        lo, hi = block * QUANT_BLOCK, (block + 1) * QUANT_BLOCK
        kind = (block // 6) % 5
        if kind == 0:
            grad[lo:hi] = 0.0
            if state_format == "int8":
                state["exp_avg"][lo:hi] = 0
                state["exp_avg_sq"][lo:hi] = 0
        elif kind == 1:
            grad[lo:hi] = 3.0e-3
        elif kind == 2:
            grad[lo:hi] = torch.randn(QUANT_BLOCK, generator=gen) * 1e-40
        elif kind == 3:
            grad[lo:hi] = torch.randn(QUANT_BLOCK, generator=gen) * 1e18
        else:
            grad[lo:hi] = 0.0
            grad[lo + 17] = -2.5e-2
    return master, grad, state


@needs_numba
@pytest.mark.parametrize("state_format", ["bf16", "int8"])
def test_kernels_are_bit_identical_to_the_torch_reference_on_edge_cases(state_format: str) -> None:
    """The fused kernels against the torch path, the reference written op by op from state_formats'
    recipe (``CompactAdamW(fused=False)``), on data that exercises every branch of the kernels' integer
    shortcuts (the hash index's carry into its high half split off into its own run, the codes' range
    tests done as float compares, the signed conversion): masters, codes and scales bit for bit, over
    steps with and without decay, a gradient scale, bf16 and fp32 gradients, a small and a large beta1
    (lerp from either end), for ranges whose hash indices cross 2^32 inside a 64-element block and inside
    a 4096-element work item, and for a range that does not (Note [Streamed updates are the host's
    arithmetic])."""
    from slide_core.master_store import Fp32Master

    n = 64 * 150
    for origin in (0, 2**32 - 32, 2**32 - 5096, 2**33 + 64):  # index 2^32 at element 32, at 5096, nowhere
        for beta1 in (0.9, 0.3):
            config = AdamWConfig(weight_decay=0.1, beta1=beta1, state_format=state_format, state_seed=11)
            master, grad, state = _edge_case_range(state_format, n, seed=origin % 1000 + int(beta1 * 10))
            results = []
            for fused in (True, False):
                optimizer = CompactAdamW(config, fused=fused, threads=2)
                values, moments = master.clone(), {k: t.clone() for k, t in state.items()}
                for step, (decay, scale, dtype) in enumerate(
                    [(True, 1.0, torch.float32), (False, 0.5, torch.bfloat16), (True, 1.0, torch.bfloat16)], start=1
                ):
                    optimizer.step(
                        Fp32Master(values, origin), grad.to(dtype) * step, moments, lr=1e-3, step=step,
                        decay=decay, grad_scale=scale,
                    )  # fmt: skip
                results.append((values, moments))
            (master_k, state_k), (master_t, state_t) = results
            for name in state_k:
                assert torch.equal(_bits(state_k[name]), _bits(state_t[name])), (origin, beta1, name)
            assert torch.equal(_bits(master_k), _bits(master_t)), (origin, beta1)


@needs_numba
def test_int8_kernel_keeps_a_partial_last_block_bit_identical() -> None:
    """A range that ends inside a 64-element block (which ``CompactAdamW`` refuses but the kernel handles,
    scaling the block by its elements only) stores the codes the torch reference gives the range padded
    with zeros: zero moments and gradients change neither the block's largest magnitude nor the others'
    codes."""
    import numpy as np

    from slide_core.optim import _adamw_kernels
    from slide_core.optim.compact_adamw import _kernels, _moment_array

    n, tail = 64 * 9, 64 * 9 - 23
    config = AdamWConfig(weight_decay=0.1, state_format="int8", state_seed=5)
    master, grad, state = _edge_case_range("int8", n, seed=3)
    master[tail:], grad[tail:] = 0.0, 0.0
    state["exp_avg"][tail:], state["exp_avg_sq"][tail:] = 0, 0
    key = stream_key(config.state_seed, 4)
    origin = 2**32 - 64 * 8 - 40  # the low half of the hash index also wraps inside a block
    want_master, want_state = master.clone(), {k: t.clone() for k, t in state.items()}
    from slide_core.master_store import Fp32Master

    CompactAdamW(config, fused=False).step(
        Fp32Master(want_master, origin), grad, want_state, lr=1e-3, step=4, decay=True, grad_scale=0.5
    )
    got_master = master.clone()[:tail]
    got_state = {k: t.clone() for k, t in state.items()}
    got_state["exp_avg"], got_state["exp_avg_sq"] = got_state["exp_avg"][:tail], got_state["exp_avg_sq"][:tail]
    moments = tuple(_moment_array(got_state[name], name) for name in ("exp_avg", "exp_avg_sq"))
    scales = tuple(got_state[name].numpy() for name in ("exp_avg_scale", "exp_avg_sq_scale"))
    _kernels().step[("int8", "fp32")](
        got_master.numpy(), _adamw_kernels.grad_array(grad[:tail]), *moments, *scales, np.int64(origin),
        np.uint32(key[0]), np.uint32(key[1]), np.float32(0.5), *_adamw_kernels.step_scalars(config, 1e-3, 4, True),
    )  # fmt: skip
    assert torch.equal(_bits(got_master), _bits(want_master[:tail]))
    for name, tensor in got_state.items():
        assert torch.equal(_bits(tensor), _bits(want_state[name][: tensor.numel()])), name


@pytest.mark.parametrize(("state_format", "rtol"), [("bf16", 0.02), ("int8", 0.1)])
def test_compact_updates_follow_fp32_adamw(state_format: str, rtol: float) -> None:
    """Over 20 steps the parameter change stays within ``rtol`` (relative, 2-norm) of fp32 AdamW's."""
    n = 64 * 64
    start = torch.randn(n, generator=torch.Generator().manual_seed(4)) * 0.02
    grads = _grads(n, 20, torch.float32, seed=7)
    reference = start.clone()
    _run_steps(TorchAdamW(AdamWConfig(weight_decay=0.1)), reference, _empty_state("fp32", n), grads)
    compact = start.clone()
    _run_steps(
        CompactAdamW(AdamWConfig(weight_decay=0.1, state_format=state_format)),
        compact,
        _empty_state(state_format, n),
        grads,
    )
    error = (compact - reference).norm() / (reference - start).norm()
    assert error < rtol, f"{state_format}: {error:.3g}"


# -- the torch path in chunks (device-resident units) ------------------------------------------------------
CHUNK = 64 * 150
"""A chunk small enough that the ranges below span several, ending inside one."""


def _master_of(kind: str, values: torch.Tensor, offset: int):
    """The range ``values[offset:]`` as an fp32 slice of its slab or as a split master (same numbering)."""
    from slide_core.split_master import SplitMaster, tie_bytes

    if kind == "fp32":
        return values.clone()[offset:]
    planes = SplitMaster(
        torch.empty(values.numel(), dtype=torch.bfloat16),
        torch.empty(values.numel(), dtype=torch.int16),
        torch.zeros(tie_bytes(values.numel()), dtype=torch.uint8),
    )
    planes.encode_(values)
    return planes[offset:]


def _values(master) -> torch.Tensor:
    return master if isinstance(master, torch.Tensor) else master.decode()


def _steps_and_corrections(optimizer, master, state, grads) -> None:
    """Steps 1-3 with a grad scale at step 2, each followed by clipping's correction: a rescale with a
    device-style 0-dim coefficient, an undo with a float one, a rescale after a scaled step."""
    from slide_core.optimizer import Correction

    plan = [
        (1.0, torch.tensor(1.0), Correction("rescale", 0.3)),
        (0.5, 0.5, Correction("undo")),
        (0.25, torch.tensor(0.25), Correction("rescale", 0.125)),
    ]
    for step, (grad, (scale, applied, correction)) in enumerate(zip(grads, plan, strict=True), start=1):
        optimizer.step(master, grad, state, lr=1e-3, step=step, decay=True, grad_scale=scale)
        optimizer.correct(master, grad, state, applied=applied, correction=correction, lr=1e-3, step=step, decay=True)


@pytest.mark.parametrize("master_kind", ["fp32", "split"])
@pytest.mark.parametrize("state_format", ["bf16", "int8"])
def test_chunked_torch_path_is_bit_identical_to_one_pass(state_format: str, master_kind: str) -> None:
    """The torch path (what device-resident units run) updates and corrects a range a chunk at a time,
    each element hashed at its own slab index: master and codes are bit for bit those of one pass over
    the whole range, for a range of several chunks that ends inside one."""
    n = 64 * 520 + (37 if state_format == "bf16" else 0)  # 3.5 chunks; bf16 ranges need not be blocks
    offset = 4096 - 192
    assert n > 3 * CHUNK and n % CHUNK
    values = torch.randn(offset + n, generator=torch.Generator().manual_seed(21)) * 0.02
    config = AdamWConfig(weight_decay=0.1, state_format=state_format, state_seed=6)
    grads = _grads(n, 3, torch.bfloat16, seed=22)
    results = []
    for chunk in (CHUNK, 64 * (n // 64 + 1)):
        optimizer = CompactAdamW(config, fused=False, chunk_numel=chunk)
        master, state = _master_of(master_kind, values, offset), _empty_state(state_format, n)
        _steps_and_corrections(optimizer, master, state, grads)
        results.append((_values(master), state))
    (master_c, state_c), (master_1, state_1) = results
    assert torch.equal(_bits(master_c), _bits(master_1))
    for name, tensor in state_1.items():
        assert torch.equal(_bits(state_c[name]), _bits(tensor)), name


@needs_numba
@pytest.mark.parametrize("master_kind", ["fp32", "split"])
@pytest.mark.parametrize("state_format", ["bf16", "int8"])
def test_chunked_torch_path_matches_the_kernels(state_format: str, master_kind: str) -> None:
    """The chunked torch path stores the numba kernels' codes bit for bit over several steps (the master
    to the kernel's sqrt, as one pass does: ``test_kernel_matches_the_torch_path``)."""
    n = 64 * 520 + (37 if state_format == "bf16" else 0)
    offset = 4096 - 192
    values = torch.randn(offset + n, generator=torch.Generator().manual_seed(23)) * 0.02
    config = AdamWConfig(weight_decay=0.1, state_format=state_format, state_seed=7)
    results = []
    for fused in (True, False):
        master, state = _master_of(master_kind, values, offset), _empty_state(state_format, n)
        optimizer = CompactAdamW(config, fused=fused, chunk_numel=CHUNK)
        _run_steps(optimizer, master, state, _grads(n, 4, torch.bfloat16, seed=24), scales=[1, 0.5, 1, 1])
        results.append((_values(master), state))
    (master_k, state_k), (master_t, state_t) = results
    for name in state_k:
        assert torch.equal(_bits(state_k[name]), _bits(state_t[name])), name
    torch.testing.assert_close(master_k, master_t, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("numel", [64 * 520, 64 * 100])
@pytest.mark.parametrize("state_format", ["bf16", "int8"])
def test_device_scratch_bytes_is_what_the_torch_path_allocates(state_format: str, numel: int) -> None:
    """A fresh device replica's step (bf16 gradients, as a resident unit's slot holds) and correction (a
    0-dim coefficient, as resident units pass) allocate, at their peak, exactly ``device_scratch_bytes``:
    a chunk's scratch and codec temporaries, not fp32 copies of a range several chunks long. This number
    is what the planner adds to the GPU peak of a run with resident units."""
    from slide_core.alloc_counter import AllocationCounter
    from slide_core.optim.state_formats import codec_scratch_bytes
    from slide_core.optimizer import Correction

    config = AdamWConfig(weight_decay=0.1, state_format=state_format)
    optimizer = CompactAdamW(config, chunk_numel=CHUNK).device_replica()
    master, grad = torch.randn(numel) * 0.02, _grads(numel, 1, torch.bfloat16)[0]
    state = _empty_state(state_format, numel)
    with AllocationCounter() as counter:
        optimizer.step(master, grad, state, lr=1e-3, step=1, decay=True)
        stepped = counter.peak_bytes
        optimizer.correct(
            master, grad, state, applied=torch.tensor(0.5), correction=Correction("undo"), lr=1e-3, step=1, decay=True
        )
    assert stepped == optimizer.device_scratch_bytes(numel)
    assert counter.peak_bytes == optimizer.device_scratch_bytes(numel, corrects=True)
    chunk = min(numel, CHUNK)
    fp32_step = TorchAdamW(AdamWConfig()).device_scratch_bytes(chunk)  # an fp32 gradient chunk, a step count
    assert optimizer.device_scratch_bytes(numel) == 8 * chunk + fp32_step + codec_scratch_bytes(state_format, chunk)


def test_codec_scratch_bytes_is_what_encode_and_decode_allocate() -> None:
    """The codec's temporaries grow with the range exactly as ``codec_scratch_bytes`` says (the larger of
    encode and decode), for ranges of a few blocks and of many."""
    from slide_core.alloc_counter import AllocationCounter
    from slide_core.optim.state_formats import codec_scratch_bytes

    for state_format in ("fp32", "bf16", "int8"):
        for numel in (64 * 3, 64 * 1001):
            m, v = torch.randn(numel), torch.rand(numel)
            state = _empty_state(state_format, numel)
            peaks = []
            for code in (
                lambda: encode_moments(state_format, m, v, state, index0=7, key=stream_key(1, 2)),  # noqa: B023
                lambda: decode_moments(state_format, state, m, v),  # noqa: B023
            ):
                with AllocationCounter() as counter:
                    code()
                peaks.append(counter.peak_bytes)
            assert max(peaks) == codec_scratch_bytes(state_format, numel), (state_format, numel, peaks)


def test_chunks_must_keep_int8_blocks_whole() -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        CompactAdamW(AdamWConfig(state_format="int8"), chunk_numel=1000)


def test_other_optimizers_refuse_a_compact_state() -> None:
    from slide_core.plugins import PluginError

    with pytest.raises(ValueError, match="optimizer state format must be"):
        AdamWConfig(state_format="fp16")
    with pytest.raises(ValueError, match="CompactAdamW stores bf16 or int8"):
        CompactAdamW(AdamWConfig())
    cfg = ToyConfig(num_layers=1)
    model = ToyModel(cfg)
    with CPUDevice() as device, pytest.raises(ValueError, match=r"TorchAdamW keeps fp32 state.*bf16"):
        Engine(model, device, HostParameters(model), TorchAdamW(AdamWConfig(state_format="bf16")))
    assert isinstance(build_optimizer("torch-adamw", AdamWConfig(state_format="bf16")), CompactAdamW)
    with pytest.raises(PluginError, match="keeps fp32 state"):
        build_optimizer("some-other", AdamWConfig(state_format="int8"))


# -- the engine ------------------------------------------------------------------------------------------
TOY = ToyConfig(tie_embeddings=True, num_layers=4, vocab_size=512, hidden_size=64)


def _engine(
    state_format: str,
    batches,
    *,
    fused: bool | None = None,
    config: EngineConfig | None = None,
    tier=None,
    save_to=None,
    restore=None,
    init_seed: int = 11,
):
    """Losses, the final master and the host state (gathered by a drain) of a toy run."""
    from slide_core.checkpoint import save_checkpoint

    model = ToyModel(TOY)
    adam = AdamWConfig(weight_decay=0.1, state_format=state_format, state_seed=5)
    optimizer = TorchAdamW(adam) if state_format == "fp32" else CompactAdamW(adam, fused=fused)
    config = config or EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024)
    with CPUDevice() as device:
        host = HostParameters(model)
        load_init(host, toy_init(model, seed=init_seed))
        with Engine(model, device, host, optimizer, config, state_tier=tier) as engine:
            if restore is not None:
                engine.restore_schedule_state({"step": engine.restore_checkpoint(restore)["step"]})
            losses = [engine.step(micro, lr=3e-3).loss for micro in batches]
            saved = save_checkpoint(save_to, engine.step_count, engine.checkpoint_arrays(), {}) if save_to else None
            engine.drain(with_state=True)
            state = {k: v.clone() for k, v in engine.host_state.state_slabs.items()}
        return losses, host.slab.clone(), state, saved


@pytest.mark.parametrize(("state_format", "rtol"), [("bf16", 2e-4), ("int8", 2e-3)])
def test_engine_trains_close_to_fp32_state(state_format: str, rtol: float) -> None:
    """Six steps with clipping on a tied toy model: the loss falls and stays within ``rtol`` of the fp32
    state's losses (the moments differ by their rounding only)."""
    batches = toy_batches(TOY, steps=6, accum=2, seed=3)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, max_grad_norm=1.0)
    reference = _engine("fp32", batches, config=config)[0]
    losses = _engine(state_format, batches, config=config)[0]
    assert losses[-1] < losses[0]
    assert losses == pytest.approx(reference, rel=rtol)


@pytest.mark.parametrize("state_format", ["bf16", "int8"])
def test_engine_is_bit_reproducible_and_resumes_bit_identically(state_format: str, tmp_path) -> None:
    batches = toy_batches(TOY, steps=4, accum=1, seed=8)
    first = _engine(state_format, batches)
    second = _engine(state_format, batches)
    assert first[0] == second[0] and torch.equal(first[1], second[1])
    _, _, _, saved = _engine(state_format, batches[:2], save_to=tmp_path)
    resumed = _engine(state_format, batches[2:], restore=saved, init_seed=12)  # other weights, overwritten
    assert resumed[0] == first[0][2:]
    assert torch.equal(resumed[1], first[1])
    for name, tensor in first[2].items():
        assert torch.equal(_bits(resumed[2][name]), _bits(tensor)), name


def test_resume_refuses_another_state_format(tmp_path) -> None:
    batches = toy_batches(TOY, steps=1, accum=1, seed=8)
    _, _, _, saved = _engine("bf16", batches, save_to=tmp_path)
    with pytest.raises(ValueError, match="holds bf16 optimizer state; this run uses int8"):
        _engine("int8", batches, restore=saved)
    with pytest.raises(ValueError, match="holds bf16 optimizer state; this run uses fp32"):
        _engine("fp32", batches, restore=saved)


@pytest.mark.parametrize("state_format", ["bf16", "int8"])
def test_offloaded_compact_state_is_bit_identical_to_ram(state_format: str) -> None:
    """Compact moments staged through a tier (Note [Staging reuse ordering]) give the bits of keeping
    them in RAM: the hash index is the master's, wherever the state is staged."""
    from slide_core.tiers.host_ram import HostRamTier

    batches = toy_batches(TOY, steps=3, accum=2, seed=9)
    base = dict(compute_dtype=torch.float32, transfer_chunk_numel=1024, max_grad_norm=0.05)
    ram = _engine(state_format, batches, config=EngineConfig(**base))
    with HostRamTier() as tier:
        offloaded = ("layers.0", "layers.2", "layers.3", "embed")
        nvme = _engine(state_format, batches, config=EngineConfig(**base, offloaded_units=offloaded), tier=tier)
    assert nvme[0] == ram[0]
    assert torch.equal(nvme[1], ram[1])
    for name, tensor in ram[2].items():
        assert torch.equal(_bits(nvme[2][name]), _bits(tensor)), name


def test_device_resident_units_keep_compact_state() -> None:
    """A device-resident unit stores its moments in the format too (updated by the torch path)."""
    batches = toy_batches(TOY, steps=3, accum=1, seed=10)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, resident_units=("layers.1",))
    losses, _, state, _ = _engine("int8", batches, config=config)
    assert (
        state["exp_avg"].dtype == torch.int8
        and state["exp_avg_sq_scale"].numel() * QUANT_BLOCK == state["exp_avg"].numel()
    )
    reference = _engine("int8", batches)[0]
    assert losses == pytest.approx(reference, rel=1e-3)


@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_numba), False])
@pytest.mark.parametrize("state_format", ["bf16", "int8"])
def test_split_master_gives_the_same_compact_state(state_format: str, fused: bool) -> None:
    """A split master (slide_core/split_master.py) numbers its elements like the fp32 slab, so the same
    steps give bit-identical moments and a master that decodes to the fp32 run's bits."""
    from slide_core.split_master import SplitMaster, tie_bytes

    n, offset = 64 * 130, 4096 - 192  # a range whose work items straddle the tie numbering's 4096 blocks
    values = torch.randn(offset + n, generator=torch.Generator().manual_seed(5)) * 0.02
    values[offset : offset + 64] = torch.tensor([1.0 + 2.0**-8] * 64)  # low half 0x8000: tie bits in use
    config = AdamWConfig(weight_decay=0.1, state_format=state_format, state_seed=2)
    grads = _grads(n, 4, torch.bfloat16, seed=3)
    plain = values.clone()[offset:]
    plain_state = _empty_state(state_format, n)
    _run_steps(CompactAdamW(config, fused=fused), plain, plain_state, grads, scales=[1, 0.5, 1, 1])
    planes = SplitMaster(
        torch.empty(offset + n, dtype=torch.bfloat16),
        torch.empty(offset + n, dtype=torch.int16),
        torch.zeros(tie_bytes(offset + n), dtype=torch.uint8),
    )
    planes.encode_(values)
    split = planes[offset:]
    split_state = _empty_state(state_format, n)
    _run_steps(CompactAdamW(config, fused=fused), split, split_state, grads, scales=[1, 0.5, 1, 1])
    assert torch.equal(_bits(split.decode()), _bits(plain))
    for name, tensor in plain_state.items():
        assert torch.equal(_bits(split_state[name]), _bits(tensor)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("state_format", ["bf16", "int8"])
def test_compact_state_on_a_gpu_with_resident_units(state_format: str) -> None:
    """bf16 compute on CUDA, host-updated units (numba kernels) and a device-resident one (the torch path
    on the GPU): the run trains and stays close to the fp32 state's losses."""
    from slide_core.devices.cuda import CUDADevice

    model = ToyModel(TOY)
    batches = toy_batches(TOY, steps=1, accum=1, seed=12) * 6  # one batch, learnt: the loss must fall

    def run(fmt: str) -> list[float]:
        adam = AdamWConfig(weight_decay=0.1, state_format=fmt, state_seed=1)
        optimizer = TorchAdamW(adam) if fmt == "fp32" else CompactAdamW(adam)
        config = EngineConfig(compute_dtype=torch.bfloat16, resident_units=("layers.2",), max_grad_norm=1.0)
        with CUDADevice() as device:
            host = HostParameters(model)
            load_init(host, toy_init(model, seed=13))
            with Engine(model, device, host, optimizer, config) as engine:
                return [engine.step(micro, lr=3e-3).loss for micro in batches]

    reference, losses = run("fp32"), run(state_format)
    assert losses[-1] < losses[0], losses
    assert losses == pytest.approx(reference, rel=5e-2), (losses, reference)


def test_int8_state_needs_block_aligned_chunks() -> None:
    model = ToyModel(TOY)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1000 * 64 + 1)
    optimizer = CompactAdamW(AdamWConfig(state_format="int8"), fused=False)
    with CPUDevice() as device, pytest.raises(ValueError, match="multiple of 64"):
        Engine(model, device, HostParameters(model), optimizer, config)


@pytest.mark.parametrize("state_format", ["bf16", "int8"])
def test_correction_takes_an_update_back_to_the_formats_rounding(state_format: str) -> None:
    """Clipping's undo of a compact-state update: at step 1 the moments are exactly zero again; later the
    decoded moments and the master come back to within the format's rounding of what they were."""
    from slide_core.optimizer import Correction

    n = 64 * 32
    config = AdamWConfig(weight_decay=0.1, state_format=state_format)
    optimizer = CompactAdamW(config)
    master = torch.randn(n, generator=torch.Generator().manual_seed(8)) * 0.02
    state = _empty_state(state_format, n)
    grads = _grads(n, 3, torch.float32, seed=9)
    undo = Correction("undo")
    optimizer.step(master, grads[0], state, lr=1e-3, step=1, decay=True)
    first = master.clone()
    optimizer.correct(master, grads[0], state, applied=1.0, correction=undo, lr=1e-3, step=1, decay=True)
    assert all(int(t.count_nonzero()) == 0 for t in state.values())
    optimizer.step(master, grads[0], state, lr=1e-3, step=1, decay=True)
    assert torch.equal(master, first) or torch.allclose(master, first, rtol=1e-6, atol=1e-9)
    before_master = master.clone()
    before = [torch.empty(n), torch.empty(n)]
    decode_moments(state_format, state, *before)
    optimizer.step(master, grads[1], state, lr=1e-3, step=2, decay=True)
    optimizer.correct(master, grads[1], state, applied=1.0, correction=undo, lr=1e-3, step=2, decay=True)
    after = [torch.empty(n), torch.empty(n)]
    decode_moments(state_format, state, *after)
    rel = {"bf16": 2e-2, "int8": 0.3}[state_format]  # a few roundings of the format, relative to the block
    for got, want in zip(after, before, strict=True):
        scale = want.abs().view(-1, QUANT_BLOCK).amax(1).repeat_interleave(QUANT_BLOCK)
        assert bool(((got - want).abs() <= rel * scale + 1e-12).all())
    # The master comes back to within a fraction of one update (lr = 1e-3): the reversal divides by the
    # stored moments, not the fp32 ones the update used.
    error = float((master - before_master).abs().max()) / 1e-3
    assert error < {"bf16": 0.05, "int8": 0.6}[state_format], error
