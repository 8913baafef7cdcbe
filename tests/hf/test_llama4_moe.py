"""Llama 4's experts, each token through its chosen ones alone (slide_hf/adapters/llama4_moe.py), against
transformers' Llama4TextMoe, which runs every token through every expert: the same output, router logits and
gradients in fp32, with one and with two experts a token, and the experts' matmuls over the chosen rows only."""

from __future__ import annotations

import copy

import pytest
import torch

from slide_hf import PRESETS
from slide_hf.adapters import llama4_moe


def _moe(top_k: int) -> torch.nn.Module:
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = PRESETS["test-llama4"]()
    config.num_experts_per_tok = top_k
    torch.manual_seed(top_k)
    moe = Llama4TextMoe(config)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.3)  # HF initialises gate_up_proj to zeros
    return moe


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_routed_forward_is_hfs_module_forward_and_backward(top_k: int) -> None:
    hf = _moe(top_k)
    ours = copy.deepcopy(hf)
    llama4_moe.route_experts_by_token(_holder(ours))
    hidden = torch.randn(3, 7, hf.hidden_dim, generator=torch.Generator().manual_seed(1))
    x_hf, x_ours = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    out_hf, logits_hf = hf(x_hf)
    out_ours, logits_ours = ours(x_ours)
    assert torch.equal(logits_ours, logits_hf)
    torch.testing.assert_close(out_ours, out_hf, rtol=1e-5, atol=1e-5)  # matmul kernels' rounding
    grad = torch.randn_like(out_hf)
    out_hf.backward(grad)
    out_ours.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=1e-5, atol=1e-5)
    for (name, p_ours), p_hf in zip(ours.named_parameters(), hf.parameters(), strict=True):
        torch.testing.assert_close(p_ours.grad, p_hf.grad, rtol=1e-5, atol=1e-5, msg=name)


def _holder(moe: torch.nn.Module) -> torch.nn.Module:
    holder = torch.nn.Module()
    holder.feed_forward = moe
    return holder


def test_the_experts_multiply_the_chosen_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """14 tokens, 2 of 4 experts each: 28 rows through each grouped matmul, where HF's module multiplies
    4 x 14 = 56."""
    moe = _moe(2)
    llama4_moe.route_experts_by_token(_holder(moe))
    rows = []
    grouped = llama4_moe.grouped_mm

    def counting(inputs: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        rows.append(inputs.shape[0])
        assert int(ends[-1]) == inputs.shape[0]
        return grouped(inputs, weights, ends)

    monkeypatch.setattr(llama4_moe, "grouped_mm", counting)
    moe(torch.randn(2, 7, moe.hidden_dim))
    assert rows == [28, 28]


def test_the_adapter_routes_every_moe_layer_and_leaves_dense_ones() -> None:
    from slide_hf import build_model

    model = build_model(PRESETS["test-llama4"]())
    routed = [block.root.feed_forward.forward.__func__ is llama4_moe.routed_experts_forward for block in model.blocks]
    assert routed == [False, True]  # test-llama4: a dense layer, then an MoE one


def test_the_grouped_product_without_the_grouped_kernel_is_the_same() -> None:
    """fp16 on the CPU (as fp32 or fp16 on a GPU): one matmul per group, empty groups included."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(9, 8, generator=generator)
    weights = torch.randn(4, 8, 6, generator=generator)
    ends = torch.tensor([2, 2, 7, 9], dtype=torch.int32)  # the second group is empty
    expected = torch.cat([rows[0:2] @ weights[0], rows[2:7] @ weights[2], rows[7:9] @ weights[3]])
    torch.testing.assert_close(llama4_moe.grouped_mm(rows, weights, ends), expected)
    looped = llama4_moe.grouped_mm(rows.half(), weights.half(), ends)
    torch.testing.assert_close(looped.float(), expected, rtol=2e-2, atol=2e-2)
    on_meta = llama4_moe.grouped_mm(rows.to("meta"), weights.to("meta"), ends.to("meta"))
    assert on_meta.shape == (9, 6) and on_meta.device.type == "meta"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_the_gpu_the_routed_forward_is_hfs(dtype: torch.dtype) -> None:
    """bf16 through torch's grouped kernel, fp32 through a matmul per expert (the kernel takes bf16 only on
    CUDA), against HF's module on the same card; every expert's rows at Scout-like widths' alignment."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = PRESETS["test-llama4"]()
    config.hidden_size, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok = 256, 512, 8, 1
    torch.manual_seed(0)
    hf = Llama4TextMoe(config).to("cuda", dtype)
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.05)
    ours = copy.deepcopy(hf)
    llama4_moe.route_experts_by_token(_holder(ours))
    hidden = torch.randn(4, 512, 256, device="cuda", dtype=dtype)
    x_hf, x_ours = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    (out_hf, _), (out_ours, _) = hf(x_hf), ours(x_ours)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(out_ours, out_hf, **tol)
    grad = torch.randn_like(out_hf)
    out_hf.backward(grad)
    out_ours.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, **tol)
    for p_ours, p_hf in zip(ours.parameters(), hf.parameters(), strict=True):
        torch.testing.assert_close(p_ours.grad, p_hf.grad, **tol)
