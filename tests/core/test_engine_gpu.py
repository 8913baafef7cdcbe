"""The engine on a CUDA GPU: fp32 against the CPU reference, bf16 against a plain bf16 loop."""

from __future__ import annotations

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.testing import ToyConfig, ToyModel, reference_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _batches(cfg: ToyConfig, steps: int, device: str = "cpu"):
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (4, 64), generator=generator)
        out.append([(ids, ids.clone())])
    return out


def _engine_losses(
    cfg: ToyConfig,
    init,
    batches,
    dtype: torch.dtype,
    lr: float,
    resident: tuple[str, ...] = (),
    *,
    pinned_slab: bool = True,
    max_grad_norm: float = 0.0,
    streamed: tuple[str, ...] = (),
) -> list[float]:
    """``pinned_slab=False``: the slab `slide train` uses, which the engine pins in part and whose resident
    ranges it gives back (Note [Resident host copies])."""
    from slide_core.devices.cuda import CUDADevice

    model = ToyModel(cfg)
    with CUDADevice() as device:
        host = HostParameters(model, device.alloc_pinned) if pinned_slab else HostParameters(model)
        for unit in model.units:
            for name, view in host.views(unit).items():
                view.copy_(init[unit.name][name])
        config = EngineConfig(
            block_slots=2,
            compute_dtype=dtype,
            transfer_chunk_numel=4096,
            resident_units=resident,
            max_grad_norm=max_grad_norm,
            streamed_units=streamed,
        )
        with Engine(model, device, host, TorchAdamW(AdamWConfig(weight_decay=0.01)), config) as engine:
            return [engine.step(micro, lr).loss for micro in batches]


def _plain_losses(
    cfg: ToyConfig, init, batches, dtype: torch.dtype, lr: float, device: str, max_grad_norm: float = 0.0
) -> list[float]:
    """Plain PyTorch: fp32 master parameters, compute on bf16 copies, torch AdamW on the masters (after
    ``clip_grad_norm_`` when ``max_grad_norm`` is set: every step must clip)."""
    model = ToyModel(cfg)
    master = {u: {n: torch.nn.Parameter(t.clone().to(device)) for n, t in v.items()} for u, v in init.items()}
    flat = [p for v in master.values() for p in v.values()]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in flat if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for p in flat if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
    )
    losses = []
    for micro in batches:
        ids, labels = (t.to(device) for t in micro[0])
        low = {u: {n: p.to(dtype) for n, p in v.items()} for u, v in master.items()}
        loss_sum = reference_loss(model, low, ids, labels)
        tokens = int((labels[:, 1:] != -100).sum())
        (loss_sum / tokens).backward()
        losses.append(loss_sum.item() / tokens)
        if max_grad_norm:
            grads = [p.grad for p in flat]
            total = torch.nn.utils.get_total_norm(grads)
            assert total > max_grad_norm, "test setup: every step must clip"
            torch.nn.utils.clip_grads_with_norm_(flat, max_grad_norm, total)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _init(cfg: ToyConfig):
    model = ToyModel(cfg)
    init = {unit.name: {s.name: torch.empty(s.shape) for s in unit.layout} for unit in model.units}
    model.init_(init, 11)
    return init


@pytest.mark.parametrize("tied", [False, True])
def test_fp32_on_gpu_matches_cpu_reference(tied: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ToyConfig(hidden_size=64, num_layers=4, tie_embeddings=tied)
    init = _init(cfg)
    batches = _batches(cfg, 6)
    got = _engine_losses(cfg, init, batches, torch.float32, 2e-3, ("layers.1",))
    want = _plain_losses(cfg, init, batches, torch.float32, 2e-3, "cpu")
    assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("pinned_slab", [True, False])
@pytest.mark.parametrize("resident", [(), ("embed", "layers.0", "head")])
def test_bf16_on_gpu_tracks_plain_bf16(resident: tuple[str, ...], pinned_slab: bool) -> None:
    cfg = ToyConfig(vocab_size=512, hidden_size=256, num_heads=8, intermediate_size=688, num_layers=6)
    init = _init(cfg)
    batches = _batches(cfg, 12)
    got = _engine_losses(cfg, init, batches, torch.bfloat16, 1e-3, resident, pinned_slab=pinned_slab)
    want = _plain_losses(cfg, init, batches, torch.bfloat16, 1e-3, "cuda")
    assert got[0] == pytest.approx(want[0], rel=1e-2)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a == pytest.approx(b, rel=3e-2), f"step {step + 1}: engine {a:.4f} vs plain {b:.4f}"
    assert got[-1] < got[0]


@pytest.mark.parametrize("pinned_slab", [True, False])
def test_streamed_updates_on_gpu_track_plain_bf16(pinned_slab: bool) -> None:
    """GPU-streamed units (streamed_pipeline.py) beside a resident one and host-updated ones, on the slab
    `slide train` uses (pinned in part by the engine) and on a pinned one: bf16 tracks plain bf16."""
    cfg = ToyConfig(vocab_size=512, hidden_size=256, num_heads=8, intermediate_size=688, num_layers=6)
    init = _init(cfg)
    batches = _batches(cfg, 12)
    streamed = ("layers.1", "layers.2", "layers.4", "head")
    got = _engine_losses(
        cfg, init, batches, torch.bfloat16, 1e-3, ("layers.0",), pinned_slab=pinned_slab, streamed=streamed
    )
    want = _plain_losses(cfg, init, batches, torch.bfloat16, 1e-3, "cuda")
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a == pytest.approx(b, rel=3e-2), f"step {step + 1}: engine {a:.4f} vs plain {b:.4f}"
    assert got[-1] < got[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clipping_on_gpu_tracks_plain(dtype: torch.dtype) -> None:
    """Global clipping that triggers every step: the first step speculates and is corrected, the later
    ones defer (Note [Deferred clipped steps]); fp32 equals the CPU reference, bf16 tracks plain bf16."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ToyConfig(vocab_size=512, hidden_size=256, num_heads=8, intermediate_size=688, num_layers=6)
    init = _init(cfg)
    batches = _batches(cfg, 8)
    resident = ("embed", "layers.2")
    got = _engine_losses(cfg, init, batches, dtype, 1e-3, resident, max_grad_norm=0.05)
    if dtype == torch.float32:
        want = _plain_losses(cfg, init, batches, dtype, 1e-3, "cpu", max_grad_norm=0.05)
        # GPU and CPU sum in different orders; 8 clipped Adam steps drift to ~1e-4 (the CPU-device tests
        # check the engine itself to 1e-5).
        assert got == pytest.approx(want, rel=3e-4)
    else:
        want = _plain_losses(cfg, init, batches, dtype, 1e-3, "cuda", max_grad_norm=0.05)
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a == pytest.approx(b, rel=3e-2), f"step {step + 1}: engine {a:.4f} vs plain {b:.4f}"
        assert got[-1] < got[0]
