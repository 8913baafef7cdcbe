"""On a GPU, the delta rule each model chooses for its linear-attention layers (flash-linear-attention, or
transformers' torch path where fla is missing or refused) trains what the torch path trains, in bf16; and
measuring blocks on the meta device leaves the CUDA context usable (fla's kernels never run there)."""

from __future__ import annotations

import pytest
import torch

from slide_hf import build_model
from slide_hf.adapters import linear_attention as la
from slide_hf.planner.activations import BlockActivations
from slide_hf.presets import PRESETS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ = 200  # three chunks of 64 and a partial fourth


def _block_step(model, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Output, input gradient and parameter gradients of the first delta-net block, on fixed inputs."""
    block = next(b for b in model.blocks if b.attention_type == "linear_attention")
    generator = torch.Generator().manual_seed(0)
    params = {}
    for spec in block.layout:
        value = 0.05 * torch.randn(spec.shape, generator=generator)
        if spec.name.endswith("A_log"):
            value = torch.full(spec.shape, 2.0794415416798357)  # HF's mean decay rate (qwen3_next.py)
        elif spec.name.endswith(("dt_bias", "linear_attn.norm.weight")):
            value = torch.ones(spec.shape)
        params[spec.name] = value.to(device, dtype).requires_grad_()
    x = torch.randn((2, SEQ, model.config.hidden_size), generator=generator).to(device, dtype).requires_grad_()
    ids = torch.zeros((2, SEQ), dtype=torch.long, device=device)
    out = block.forward(params, x, model.prepare_inputs(ids, ids, dtype))
    out.float().square().mean().backward()
    return [out.detach(), x.grad, *(p.grad for p in params.values())]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def test_the_chosen_path_matches_the_torch_path_in_bf16(monkeypatch) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    chosen_model = build_model(PRESETS["test-qwen3.5"]())
    chosen = chosen_model.linear_attention.path_for(device, torch.bfloat16)
    if chosen.name == la.TORCH:  # say why on a machine where fla does not run
        assert chosen.reason.startswith(("flash-linear-attention", la.ENV_VAR)), chosen.reason
    monkeypatch.setenv(la.ENV_VAR, la.TORCH)
    torch_model = build_model(PRESETS["test-qwen3.5"]())
    assert torch_model.linear_attention.path_for(device, torch.bfloat16).name == la.TORCH
    got = _block_step(chosen_model, device, torch.bfloat16)
    want = _block_step(torch_model, device, torch.bfloat16)
    exact = _block_step(torch_model, device, torch.float32)
    for index, (g, w, e) in enumerate(zip(got, want, exact, strict=True)):
        assert torch.isfinite(g.float()).all(), index
        assert _relative(g, w) <= 3e-2, (chosen.describe(), index, _relative(g, w))
        assert _relative(w, e) <= 3e-2, index  # the torch path in bf16 is itself near fp32


def test_measuring_blocks_on_meta_leaves_cuda_usable() -> None:
    model = build_model(PRESETS["qwen3.5-9b"]())
    torch.ones(1, device="cuda").sum().item()  # CUDA initialised first, as in a run
    measured = BlockActivations.of(model).saved_bytes(1024, torch.bfloat16)
    assert all(value is not None and value > 0 for value in measured.values())
    torch.cuda.synchronize()  # an illegal access by a kernel launched on meta tensors would raise here
    assert torch.ones(4, device="cuda").sum().item() == 4
