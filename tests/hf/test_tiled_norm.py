"""slide_hf/adapters/tiled_norm.py: an RMSNorm over tiles of tokens computes what the module's own code does,
for each norm form (``w`` or ``1 + w``, rounding before or after the weight)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from slide_hf.adapters.tiled_norm import tile_norms
from slide_hf.adapters.token_tiles import SeqTiling

NORMS = {"llama": LlamaRMSNorm, "gemma3": Gemma3RMSNorm, "olmo2": Olmo2RMSNorm}


def _grads(norm: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_()
    norm.zero_grad()
    y = norm(x)
    y.backward(grad_out)
    return y.detach(), x.grad, norm.weight.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(NORMS))
def test_tiled_norm_matches_the_modules_own_code(family: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    reference = NORMS[family](24).to(dtype)
    with torch.no_grad():
        reference.weight.normal_(0, 0.5)
    tiled = NORMS[family](24).to(dtype)
    tiled.load_state_dict(reference.state_dict())
    assert tile_norms(tiled, SeqTiling(16)) == [""]
    x = torch.randn(2, 45, 24, dtype=dtype) * 3  # 90 rows: five tiles of 16 and one of 10
    grad_out = torch.randn(2, 45, 24, dtype=dtype)
    expected, got = _grads(reference, x, grad_out), _grads(tiled, x, grad_out)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)  # the forward is the same formula
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got[1], expected[1], **tolerance)
    # the weight gradient: bf16 per tile summed in fp32, against bf16 over the whole input
    torch.testing.assert_close(got[2].float(), expected[2].float(), **tolerance)
