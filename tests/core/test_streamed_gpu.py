"""GPU-streamed updates on a CUDA GPU with the optimizer a run builds (numba on the host, torch's fused
AdamW on the device), each state format and master format, against the host placement of the same run.

On the CPU device the two placements agree bit for bit (tests/core/test_streamed_pipeline.py). On a GPU,
torch's CUDA kernel may contract a multiply and an add into one rounding, so after one step a master may
differ from the host's in its last bits and a compact moment may, rarely, round to the neighbouring code;
this checks that the difference is of that size and nothing more (no misplaced range, no wrong offset in
the rounding's hash), and that the losses of several steps track each other."""

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


def _run(state_format: str, master_format: str, streamed: tuple[str, ...], steps: int):
    """Losses, each unit's fp32 master and host optimizer state after ``steps`` steps on the GPU."""
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
        with Engine(model, device, host, build_optimizer("auto", adam), config) as engine:
            losses = [engine.step(micro, lr=3e-3).loss for micro in batches]
            engine.drain(with_state=True)
            masters = {u.name: torch.cat([v.flatten() for v in host.read_views(u).values()]) for u in model.units}
            state = {u.name: {k: v.clone() for k, v in engine.host_state.views(u).items()} for u in model.units}
    return losses, masters, state


FORMATS = [("fp32", "fp32"), ("bf16", "fp32"), ("int8", "fp32"), ("fp32", "split"), ("bf16", "split")]


@pytest.mark.parametrize(("state_format", "master_format"), FORMATS)
def test_one_streamed_step_is_the_host_step_to_the_last_bits(state_format: str, master_format: str) -> None:
    host = _run(state_format, master_format, (), steps=1)
    streamed = _run(state_format, master_format, STREAMED, steps=1)
    for name in STREAMED:
        got, want = streamed[1][name], host[1][name]
        if name == "embed":
            # CUDA sums an embedding's gradient with atomic adds, in an order that differs run to run: a
            # gradient near zero then differs in more than its last bits, and Adam's first step (about
            # lr * sign(g)) with it. Bounded by a small share of one step of lr = 3e-3.
            assert (got - want).abs().max().item() < 3e-5, "embed: the master differs by more than 1% of a step"
            continue
        ulps = (got.view(torch.int32) - want.view(torch.int32)).abs().max().item()
        assert ulps <= 4, f"{name}: the master differs by {ulps} ulp"
        for array, tensor in host[2][name].items():
            mine = streamed[2][name][array]
            if tensor.dtype.is_floating_point and tensor.element_size() == 4:
                same = torch.isclose(mine, tensor, rtol=1e-6, atol=0.0)
            else:  # bf16 bits or int8 codes: the stochastic rounding of two values an ulp apart
                same = mine == tensor
            share = 1.0 - same.float().mean().item()
            assert share < 1e-3, f"{name}.{array}: {share:.3%} of the moments differ"


@pytest.mark.parametrize(("state_format", "master_format"), FORMATS)
def test_streamed_and_host_losses_track_over_steps(state_format: str, master_format: str) -> None:
    host = _run(state_format, master_format, (), steps=6)
    streamed = _run(state_format, master_format, STREAMED, steps=6)
    assert streamed[0] == pytest.approx(host[0], rel=1e-3)
    assert streamed[0][-1] < streamed[0][0]
