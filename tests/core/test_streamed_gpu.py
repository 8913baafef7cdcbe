"""GPU-streamed updates on a CUDA GPU with the optimizer a run builds, each state format and master format,
against the host placement of the same run: the losses of several steps track each other.

Why not bits, as on the CPU device (tests/core/test_streamed_pipeline.py): CUDA's attention and embedding
backward sum with atomic adds in an order that differs run to run, so two runs of one placement already
differ in the last bits of some gradients, and Adam's first step turns a gradient near zero into a whole
step of either sign. The update itself is checked bit for bit against the host kernel on the GPU in
tests/kernels/test_compact_adamw.py."""

from __future__ import annotations

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import build_optimizer
from slide_core.testing import ToyConfig, ToyModel, load_init, toy_batches, toy_init

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STREAMED = ("embed", "layers.0", "layers.2", "head")


def _run(state_format: str, master_format: str, streamed: tuple[str, ...], steps: int, codec: str = "torch"):
    """Losses, each unit's fp32 master and host optimizer state after ``steps`` steps on the GPU; ``codec``:
    the split master's device codec (``Optimizer.split_codec``), torch's or slide_kernels' (a run's)."""
    from slide_core.devices.cuda import CUDADevice

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ToyConfig(tie_embeddings=False, num_layers=4, hidden_size=128, intermediate_size=344, vocab_size=512)
    model = ToyModel(cfg)
    init = toy_init(model, seed=5)
    batches = toy_batches(cfg, steps=steps, accum=1, seed=9, batch=4, seq=64)
    adam = AdamWConfig(weight_decay=0.1, state_format=state_format)
    dtype = torch.bfloat16 if master_format == "split" else torch.float32
    config = EngineConfig(
        compute_dtype=dtype,
        transfer_chunk_numel=8192,
        resident_units=("layers.3",),
        block_slots=2,
        streamed_units=streamed,
    )
    with CUDADevice() as device:
        host = HostParameters(model, master_format=master_format)
        load_init(host, init)
        optimizer = build_optimizer("auto", adam)
        if codec == "triton":
            from slide_kernels.ops.split_master import TritonSplitCodec

            optimizer.split_codec = TritonSplitCodec()
        with Engine(model, device, host, optimizer, config) as engine:
            losses = [engine.step(micro, lr=3e-3).loss for micro in batches]
            engine.drain(with_state=True)
            masters = {u.name: torch.cat([v.flatten() for v in host.read_views(u).values()]) for u in model.units}
            state = {u.name: {k: v.clone() for k, v in engine.host_state.views(u).items()} for u in model.units}
    return losses, masters, state


FORMATS = [("fp32", "fp32"), ("bf16", "fp32"), ("int8", "fp32"), ("fp32", "split"), ("bf16", "split")]


@pytest.mark.parametrize(("state_format", "master_format"), FORMATS)
def test_streamed_and_host_losses_track_over_steps(state_format: str, master_format: str) -> None:
    host = _run(state_format, master_format, (), steps=6)
    streamed = _run(state_format, master_format, STREAMED, steps=6)
    assert streamed[0] == pytest.approx(host[0], rel=1e-3)
    assert streamed[0][-1] < streamed[0][0]


@pytest.mark.parametrize("state_format", ["fp32", "bf16"])
def test_the_one_launch_codec_streams_as_the_torch_one(state_format: str) -> None:
    """A split master streamed with slide_kernels' codec (what a `slide` run attaches) against torch's:
    the same losses, and masters within the 4 steps taken (CUDA's atomic sums differ run to run; the codec itself is checked bit for bit in tests/kernels/test_split_master_kernels.py)."""
    reference = _run(state_format, "split", STREAMED, steps=4, codec="torch")
    ours = _run(state_format, "split", STREAMED, steps=4, codec="triton")
    assert ours[0] == pytest.approx(reference[0], rel=1e-3)
    for name, master in ours[1].items():
        torch.testing.assert_close(master, reference[1][name], rtol=0, atol=4 * 3e-3, msg=name)  # 4 steps of lr 3e-3


def _masters(streamed: tuple[str, ...], accum: int, max_grad_norm: float, steps: int) -> tuple[list[float], dict]:
    """Losses and each unit's fp32 master after ``steps`` steps on the GPU, bf16 compute (split master, bf16
    moments: a run's defaults), with deterministic kernels (the math attention, sorted embedding sums) so
    that both placements see the same gradients; ``streamed``: the units updated on the device."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from slide_core.devices.cuda import CUDADevice

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        cfg = ToyConfig(tie_embeddings=False, num_layers=4, hidden_size=128, intermediate_size=344, vocab_size=512)
        model = ToyModel(cfg)
        init = toy_init(model, seed=5)
        batches = toy_batches(cfg, steps=steps, accum=accum, seed=9, batch=4, seq=64)
        adam = AdamWConfig(weight_decay=0.1, state_format="bf16")
        config = EngineConfig(
            compute_dtype=torch.bfloat16,
            transfer_chunk_numel=8192,
            block_slots=2,
            streamed_units=streamed,
            max_grad_norm=max_grad_norm,
        )
        with CUDADevice() as device, sdpa_kernel(SDPBackend.MATH):
            host = HostParameters(model, master_format="split")
            load_init(host, init)
            with Engine(model, device, host, build_optimizer("auto", adam), config) as engine:
                losses = [engine.step(micro, lr=LR).loss for micro in batches]
                engine.drain()
                masters = {u.name: torch.cat([v.flatten() for v in host.read_views(u).values()]) for u in model.units}
    finally:
        torch.use_deterministic_algorithms(False)
    return losses, masters


LR = 3e-3


@pytest.mark.parametrize(("accum", "max_grad_norm"), [(1, 0.05), (2, 0.0), (3, 0.0), (2, 0.05), (3, 0.05)])
def test_streamed_updates_with_clipping_and_accumulation_are_the_host_placements_within_ulps(
    accum: int, max_grad_norm: float
) -> None:
    """Note [Streamed speculation] and Note [Streamed accumulation] on a CUDA GPU, bf16 compute: one step
    that speculates (0.05 clips it, so the host corrects it) and sums 1 to 3 micro-batches, against the host
    placement of the same step. Both see the same gradients and sums; the host's AdamW and the device
    replica are the same fp32 arithmetic but for fused multiply-adds, and a summed unit's ``c_u`` comes from
    the GPU's square (an ulp from the host's), so every master is the host placement's within a few ulp of
    its value and of the step. One step only: a later one would multiply an ulp through a bf16 rounding of
    the weights into Adam's normalized step."""
    host = _masters((), accum, max_grad_norm, steps=1)
    streamed = _masters(STREAMED, accum, max_grad_norm, steps=1)
    assert streamed[0] == host[0]  # the first step's loss comes before any update
    for name, master in streamed[1].items():
        torch.testing.assert_close(master, host[1][name], rtol=2**-20, atol=LR * 2**-16, msg=name)
